"""Faults and runaway options through the CLI: signals, killed runs, broken pipes, outputs over inputs, option
ranges at parse time, downsample's files. Each failure is one line with its exit code; nothing is left behind."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sam3d_objects import cli, reconstruction
from sam3d_objects.assets.example import EXAMPLE_DIR
from conftest import root_pythonpath

IMAGE = str(EXAMPLE_DIR / "image.png")
MASK0, MASK1 = str(EXAMPLE_DIR / "0.png"), str(EXAMPLE_DIR / "1.png")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


def _cli_process(args, **kwargs):
    env = dict(os.environ, PYTHONPATH=root_pythonpath(), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "sam3d_objects.cli", *args], env=env, **kwargs)


def _one_line_error(err: str) -> bool:
    return "Traceback" not in err and len([x for x in err.strip().splitlines() if x.strip()]) == 1


# ---------------------------------------------------------------------------------------------------------------
# option ranges at parse time
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["--simplify", "2.0"], "--simplify"), (["--simplify", "nan"], "--simplify"),
    (["--turntable", "-5"], "--turntable"), (["--turntable", "1000000"], "--turntable"),
    (["--seed", "1.5"], "--seed"), (["--seed", "-1"], "--seed"), (["--steps", "1000000000"], "--steps"),
    (["--steps", "0"], "--steps"), (["--formats", "bogus"], "--formats")])
def test_option_ranges_refused_before_anything_runs(tmp_path, capsys, extra, needle):
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "out"), *extra])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert info.value.code == cli.EXIT_INPUT and needle in err and _one_line_error(err), err
    assert time.perf_counter() - start < 5 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,needle", [
    (["downsample", "x.ply", "-o", "y.ply", "--voxel", "nan"], "--voxel"),
    (["downsample", "x.ply", "-o", "y.ply", "--voxel", "-1"], "--voxel"),
    (["downsample", "x.ply", "-o", "y.ply", "--random", "1.5"], "--random"),
    (["downsample", "x.ply", "-o", "y.ply", "--uniform", "0"], "--uniform"),
    (["selfcheck", "--device", "bogus"], "bogus"),
    (["reconstruct", IMAGE, "--mask", MASK0, "--out", "o", "--device", "meta"], "meta"),
    (["reconstruct", IMAGE, "--mask", MASK0, "--out", "o", "--device", "bogus"], "bogus")])
def test_bad_values_one_line(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and needle in err and _one_line_error(err), err


# ---------------------------------------------------------------------------------------------------------------
# signals
# ---------------------------------------------------------------------------------------------------------------
def _wait_for_staging(out: Path, proc, timeout=300.0):
    end = time.time() + timeout
    while time.time() < end:
        if out.is_dir() and list(out.glob(f"{cli.STAGING_PREFIX}*")):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("signame,code", [("SIGTERM", 143), pytest.param("SIGHUP", 129, marks=pytest.mark.slow)])
def test_sigterm_and_sighup_clean_like_ctrl_c(tiny, tmp_path, signame, code):
    out = tmp_path / "out"
    proc = _cli_process(["reconstruct", IMAGE, "--mask", MASK0, "--mask", MASK1, "--out", str(out),
                         "--checkpoints", str(tiny), "--pointmap", "flat", "--steps", "1", "--no-progress",
                         "--turntable", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_for_staging(out, proc), proc.communicate()
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "terminated by signal" in err
    assert not list(out.glob(f"{cli.STAGING_PREFIX}*")) if out.exists() else True
    if out.exists():  # only complete objects, listed by summary.json
        published = sorted(p.name for p in out.iterdir())
        assert all(name in ("object_0", "summary.json") for name in published), published
        if "object_0" in published:
            summary = json.loads((out / "summary.json").read_text())
            assert [o["mask"] for o in summary["objects"]] == ["0"]


def test_second_signal_during_cleanup_is_ignored(monkeypatch):
    """A double Ctrl-C: the first signal raises, the second (while finally-blocks clean up) does not; a third
    forces the exit (a hung shutdown)."""
    guard = cli.SignalGuard()
    with pytest.raises(KeyboardInterrupt):
        guard._handle(signal.SIGINT, None)
    guard._handle(signal.SIGINT, None)  # ignored: no exception
    exits = []
    monkeypatch.setattr(reconstruction.os, "_exit", exits.append)
    guard._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]
    guard = cli.SignalGuard()
    with pytest.raises(cli.Terminated) as info:
        with guard.deferred():
            guard._handle(signal.SIGTERM, None)  # deferred to the end of the block
            done = True
    assert done and info.value.signum == signal.SIGTERM


def _signal_then(after):
    """A command whose run gets SIGTERM's exception (raised as the installed handler raises it) and then does
    ``after(exception)``: what a library's clean-up does with it."""
    def handler(args):
        try:
            cli.SIGNALS._handle(signal.SIGTERM, None)
        except KeyboardInterrupt as e:
            return after(e)
    return handler


def _reraise_as(error):
    def after(e):
        raise error from e
    return after


@pytest.mark.parametrize("after", [
    pytest.param(_reraise_as(AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")),
                 id="turned-into-internal-error"),  # omegaconf's clean-up, seen at 0.6 s into a run
    pytest.param(_reraise_as(reconstruction.UserError("not valid YAML", code=cli.EXIT_INPUT)),
                 id="turned-into-input-error"),  # ... and that error wrapped by the yaml loader
    pytest.param(lambda e: cli.EXIT_OK, id="swallowed")])
def test_a_signal_ends_the_run_as_the_signal_whatever_a_library_makes_of_it(monkeypatch, capsys, after):
    monkeypatch.setattr(cli, "_cmd_backends", _signal_then(after))
    assert cli.main(["backends"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "terminated by signal 15" in err and "error" not in err, err


def _importlib_frame():
    """A frame of code compiled under importlib's frozen file name: where a signal must not raise."""
    import sys as _sys
    found = {}
    exec(compile("found['frame'] = _sys._getframe()", "<frozen importlib._bootstrap>", "exec"),
         {"found": found, "_sys": _sys})
    return found["frame"]


def test_a_signal_inside_importlib_is_sent_again_and_raised_after_it(tmp_path):
    """A KeyboardInterrupt raised inside importlib's own code (a module lock's weakref callback, seen 0.6 s into a
    run) left the global import lock held, and the pipeline's preload thread then waited forever. The guard sends
    such a signal again a moment later and raises it outside importlib."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import signal, sys, time\n"
        "from test_security_cli import _importlib_frame\n"
        "from sam3d_objects.reconstruction import SignalGuard, Terminated\n"
        "guard = SignalGuard()\n"
        "guard.install()\n"
        "guard._handle(signal.SIGTERM, _importlib_frame())\n"
        "print('not raised in importlib', flush=True)\n"
        "try:\n"
        "    time.sleep(30)\n"
        "except Terminated as e:\n"
        "    print('raised after it', e.signum, guard.delivered, flush=True)\n"
        "    sys.exit(3)\n")
    tests_dir = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root_pythonpath(), tests_dir]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[:2] == ["not raised in importlib", "raised after it 15 15"], proc.stdout


def test_a_run_that_ends_before_the_signal_is_sent_again_still_ends_as_it(monkeypatch, capsys):
    monkeypatch.setattr(cli.SIGNALS, "REDELIVER_S", 600.0)  # cancelled by main's exit, never sent to pytest

    def handler(args):
        cli.SIGNALS._handle(signal.SIGTERM, _importlib_frame())
        return cli.EXIT_OK
    monkeypatch.setattr(cli, "_cmd_backends", handler)
    assert cli.main(["backends"]) == 128 + signal.SIGTERM
    assert "terminated by signal 15" in capsys.readouterr().err
    assert cli.SIGNALS._timer is None


def test_an_error_without_a_signal_keeps_its_own_exit_code(monkeypatch, capsys):
    def handler(args):
        raise AttributeError("a bug")
    monkeypatch.setattr(cli, "_cmd_backends", handler)
    assert cli.main(["backends"]) == cli.EXIT_ERROR
    assert "internal error: AttributeError: a bug" in capsys.readouterr().err


def test_stale_staging_of_a_killed_run_is_removed(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f"{cli.STAGING_PREFIX}{dead.pid}-abcd"
    (stale / "object_0").mkdir(parents=True)
    (stale / "object_0" / "splat.ply").write_text("half")
    alive = out / f"{cli.STAGING_PREFIX}{os.getppid()}-efgh"  # a live process's folder is left alone
    alive.mkdir()
    (out / "notes.txt").write_text("mine")
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                     "--pointmap", "flat", "--steps", "1", "--no-progress"])
    assert code == cli.EXIT_OK, capsys.readouterr().err
    assert not stale.exists() and alive.exists() and (out / "notes.txt").read_text() == "mine"
    assert (out / "splat.ply").is_file() and json.loads((out / "summary.json").read_text())["objects"]


@pytest.mark.slow  # two full runs; the clean-up rule itself: test_stale_staging_of_a_killed_run_is_removed
def test_kill_9_then_rerun_leaves_nothing(tiny, tmp_path):
    out = tmp_path / "out"
    proc = _cli_process(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                         "--pointmap", "flat", "--steps", "1", "--no-progress"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not _wait_for_staging(out, proc):
        pytest.skip("the run finished before it could be killed")
    proc.kill()
    proc.wait()
    assert list(out.glob(f"{cli.STAGING_PREFIX}*"))  # SIGKILL cannot be handled: the folder stays ...
    rerun = _cli_process(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                          "--pointmap", "flat", "--steps", "1", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert not list(out.glob(f"{cli.STAGING_PREFIX}*"))  # ... until the next run into the same --out


def test_broken_pipe_does_not_abort_the_run(tiny, tmp_path):
    out = tmp_path / "out"
    proc = _cli_process(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                         "--pointmap", "flat", "--steps", "1", "--no-progress"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(5)  # like `| head -c 5`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert proc.returncode == 0, err
    assert "BrokenPipe" not in err and (out / "splat.ply").is_file()


# ---------------------------------------------------------------------------------------------------------------
# outputs and inputs
# ---------------------------------------------------------------------------------------------------------------
def test_input_where_an_output_goes_is_refused(tiny, tmp_path, capsys):
    import shutil
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(IMAGE, out / "preview.png")
    before = (out / "preview.png").read_bytes()
    code = cli.main(["reconstruct", str(out / "preview.png"), "--mask", MASK0, "--out", str(out),
                     "--checkpoints", str(tiny), "--pointmap", "flat", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and "overwritten" in err and _one_line_error(err), err
    assert (out / "preview.png").read_bytes() == before
    shutil.copy(IMAGE, out / "photo.png")  # an input beside the outputs, under another name, is fine
    assert cli.check_inputs_not_overwritten([str(out / "photo.png")], out) is None


def test_staging_is_inside_out(tiny, tmp_path, monkeypatch):
    """Renames never cross file systems: the staging folder is created inside --out (a mount point works)."""
    seen = []
    real = reconstruction.publish

    def spy(staged, target, single, trash):
        seen.append(staged)
        return real(staged, target, single, trash)
    monkeypatch.setattr(reconstruction, "publish", spy)
    out = tmp_path / "out"
    assert cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                     "--pointmap", "flat", "--steps", "1", "--no-progress"]) == 0
    assert seen and all(out in s.parents for s in seen)


def test_downsample_never_deletes_a_file_it_did_not_create(tmp_path, capsys):
    from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian.gaussian_model import Gaussian
    import torch
    gs = Gaussian(aabb=[-1, -1, -1, 2, 2, 2], device="cpu")
    n = 50
    gs._xyz = torch.rand(n, 3)
    gs._features_dc = torch.rand(n, 1, 3)
    gs._scaling = torch.rand(n, 3)
    gs._rotation = torch.nn.functional.normalize(torch.rand(n, 4), dim=-1)
    gs._opacity = torch.rand(n, 1)
    src = tmp_path / "splat.ply"
    gs.save_ply(str(src))
    mine = tmp_path / "small.partial.ply"
    mine.write_text("the user's own file")
    assert cli.main(["downsample", str(src), "-o", str(tmp_path / "small.ply"), "--uniform", "2"]) == 0
    assert mine.read_text() == "the user's own file"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".small.")]
    code = cli.main(["downsample", str(src), "-o", str(src), "--uniform", "2"])  # never over its input
    assert code == cli.EXIT_INPUT and "input" in capsys.readouterr().err


def test_downsample_hostile_files(tmp_path, capsys):
    huge = tmp_path / "huge.ply"
    huge.write_bytes(b"ply\nformat binary_little_endian 1.0\nelement vertex 1000000000000\nproperty float x\n"
                     b"property float y\nproperty float z\nend_header\n" + b"\0" * 1024)
    start = time.perf_counter()
    code = cli.main(["downsample", str(huge), "-o", str(tmp_path / "o.ply"), "--uniform", "2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and "claims" in err and _one_line_error(err), err
    assert time.perf_counter() - start < 5
    code = cli.main(["downsample", IMAGE, "-o", str(tmp_path / "o.ply"), "--uniform", "2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and _one_line_error(err), err
    assert not (tmp_path / "o.ply").exists()


def test_non_finite_result_is_not_written(tmp_path):
    import torch
    output = {"translation": torch.tensor([[0.0, 0.0, float("inf")]]), "rotation": torch.tensor([[1.0, 0, 0, 0]]),
              "scale": torch.ones(1, 3), "coords": torch.zeros(1, 4)}
    with pytest.raises(cli.UserError) as info:
        cli.save_object(output, tmp_path / "obj", np.zeros((4, 4, 3), np.uint8), np.ones((4, 4), bool), {})
    assert info.value.code == cli.EXIT_RUN and "translation" in str(info.value)
    assert not (tmp_path / "obj").exists()
