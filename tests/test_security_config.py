"""Hostile checkpoint folders: a crafted pipeline.yaml / model yaml must never run code.

Every attack tries to write a marker file (or delete a victim folder, or echo a secret); the test asserts that
it did not, through the CLI (exit 3, one line, no traceback) and through the Python API (``Inference`` raises
``ConfigError``). The attacks are the routes found against the prefix allow-list: re-exports walked as
attributes (``sam3d_objects.reconstruction.shutil.rmtree``), loaders with their safety switched off, resolvers
that create nodes or read the environment, escaped interpolations, positional ``_args_``, ``_rpartial_target_``, a
``moge/`` package planted in the folder, and yaml alias bombs. Also run with the oldest allowed hydra-core / omegaconf
(``make test-hydra-oldest``)."""
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from sam3d_objects import cli
from sam3d_objects.assets.example import EXAMPLE_DIR
from sam3d_objects.config.safety import UnsafeConfigError, check_yaml_text, load_checkpoint_yaml, trusted_import
from sam3d_objects.validation import ConfigError
from conftest import root_pythonpath

IMAGE = str(EXAMPLE_DIR / "image.png")
MASK0 = str(EXAMPLE_DIR / "0.png")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


class _Payload:
    """Unpickling this writes the marker file named in its argument."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def _pickle_file(path: Path, marker: Path) -> Path:
    with open(path, "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    return path


def _npy_pickle(path: Path, marker: Path) -> Path:
    arr = np.empty(1, dtype=object)
    arr[0] = _Payload(str(marker))
    np.save(path, arr, allow_pickle=True)
    return path


def _attacks(folder: Path, marker: Path, victim: Path):
    """name -> (yaml file, key to set or None for raw text, value)."""
    evil_pt = _pickle_file(folder / "evil.pt", marker)
    evil_npy = _npy_pickle(folder / "evil.npy", marker)
    cmd = f"touch {marker}"
    return {
        "os_system": ("pipeline.yaml", "ss_preprocessor.extra", {"_target_": "os.system", "command": cmd}),
        "reexport_validation_os_system": ("pipeline.yaml", "ss_preprocessor.extra",
                                          {"_target_": "sam3d_objects.validation.os.system", "command": cmd}),
        "reexport_rmtree": ("pipeline.yaml", "ss_preprocessor.extra",
                            {"_target_": "sam3d_objects.reconstruction.shutil.rmtree", "path": str(victim)}),
        "torch_load_weights_only_false": ("pipeline.yaml", "layout_post_optimization_method",
                                          {"_target_": "sam3d_objects.pipeline.checkpoint.torch.load",
                                           "f": str(evil_pt), "weights_only": False}),
        "np_load_allow_pickle": ("pipeline.yaml", "ss_preprocessor.extra",
                                 {"_target_": "sam3d_objects.reconstruction.np.load", "file": str(evil_npy),
                                  "allow_pickle": True}),
        "path_write_text": ("pipeline.yaml", "ss_preprocessor.extra",
                            {"_target_": "sam3d_objects.reconstruction.Path.write_text", "_args_": [str(marker), "x"]}),
        "copyfile": ("pipeline.yaml", "ss_preprocessor.extra",
                     {"_target_": "sam3d_objects.reconstruction.shutil.copyfile", "src": str(evil_pt),
                      "dst": str(marker)}),
        "builtins_open": ("pipeline.yaml", "ss_preprocessor.extra",
                          {"_target_": "builtins.open", "file": str(marker), "mode": "w"}),
        "torch_load": ("pipeline.yaml", "ss_preprocessor.extra",
                       {"_target_": "torch.load", "f": str(evil_pt), "weights_only": False}),
        "cli_main_function": ("pipeline.yaml", "ss_preprocessor.extra",
                              {"_target_": "sam3d_objects.cli.main", "argv": ["downsample", "x", "-o", str(marker)]}),
        "oc_create": ("pipeline.yaml", "ss_preprocessor.extra",
                      "${oc.create:{_target_: os.system, command: '" + cmd + "'}}"),
        "oc_create_list": ("pipeline.yaml", "ss_preprocessor.extra",
                           "${oc.create:[{_target_: builtins.open, file: '" + str(marker) + "', mode: w}]}"),
        "oc_decode": ("pipeline.yaml", "ss_preprocessor.extra",
                      "${oc.decode:'{_target_: os.system, command: \"" + cmd + "\"}'}"),
        "target_from_env": ("pipeline.yaml", "ss_preprocessor.extra",
                            {"_target_": "${oc.env:SAM3D_TEST_EVIL_TARGET}", "command": cmd}),
        "target_by_interpolation": ("pipeline.yaml", "ss_preprocessor.extra",
                                    {"_target_": "${evil_name}", "command": cmd}),
        "escaped_interpolation": ("pipeline.yaml", "ss_preprocessor.extra",
                                  {"_target_": "sam3d_objects.config.utils.make_dict",
                                   "x": "\\${oc.create:{_target_: os.system, command: '" + cmd + "'}}"}),
        "registered_with_weights_only_false": ("pipeline.yaml", "ss_preprocessor.extra",
                                               {"_target_": "sam3d_objects.config.utils.make_dict",
                                                "weights_only": False}),
        "registered_with_args": ("pipeline.yaml", "ss_preprocessor.extra",
                                 {"_target_": "sam3d_objects.config.utils.make_dict", "_args_": [cmd]}),
        "rpartial_target": ("pipeline.yaml", "ss_preprocessor.extra",
                            {"_rpartial_target_": "os.system", "command": cmd}),
        "nested_in_list": ("pipeline.yaml", "ss_preprocessor.img_mask_joint_transform",
                           [{"_target_": "sam3d_objects.validation.os.system", "_partial_": True, "command": cmd}]),
        "model_yaml_root": ("ss_decoder.yaml", "_target_", "sam3d_objects.cli.os.system"),
        "model_yaml_nested": ("slat_generator.yaml", "module.generator.backbone.extra",
                              {"_target_": "sam3d_objects.pipeline.checkpoint.torch.load", "f": str(evil_pt),
                               "weights_only": False}),
        "moge_local_weights": ("pipeline.yaml", "depth_model",
                               {"_target_": "sam3d_objects.pipeline.depth_models.moge.MoGe",
                                "model": {"_target_": "moge.model.v1.MoGeModel.from_pretrained",
                                          "pretrained_model_name_or_path": str(evil_pt)}}),
        "unknown_parameter": ("pipeline.yaml", "ss_preprocessor.pickle_module", "os"),
    }


_NAMES = ["os_system", "reexport_validation_os_system", "reexport_rmtree", "torch_load_weights_only_false",
          "np_load_allow_pickle", "path_write_text", "copyfile", "builtins_open", "torch_load", "cli_main_function",
          "oc_create", "oc_create_list", "oc_decode", "target_from_env", "target_by_interpolation",
          "escaped_interpolation", "registered_with_weights_only_false", "registered_with_args", "rpartial_target",
          "nested_in_list", "model_yaml_root", "model_yaml_nested", "moge_local_weights", "unknown_parameter"]


def _hostile_folder(tiny, tmp_path, name):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    marker, victim = tmp_path / "MARKER", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("user data")
    attacks = _attacks(folder, marker, victim)
    assert set(attacks) == set(_NAMES)
    yaml, key, value = attacks[name]
    config = OmegaConf.load(folder / yaml)
    if name == "target_by_interpolation":
        config.evil_name = "os.system"
    OmegaConf.update(config, key, value, force_add=True, merge=False)
    OmegaConf.save(config, folder / yaml)
    return folder, marker, victim


def _assert_untouched(marker, victim):
    assert not marker.exists(), "the hostile config ran code"
    assert (victim / "keep.txt").read_text() == "user data", "the hostile config deleted a user folder"


@pytest.mark.parametrize("name", _NAMES)
def test_hostile_config_cli(tiny, tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv("SAM3D_TEST_EVIL_TARGET", "os.system")
    folder, marker, victim = _hostile_folder(tiny, tmp_path, name)
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "out"), "--checkpoints",
                     str(folder), "--pointmap", "flat", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    _assert_untouched(marker, victim)
    assert code == cli.EXIT_CHECKPOINT, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", _NAMES)
def test_hostile_config_api(tiny, tmp_path, monkeypatch, name):
    from sam3d_objects.inference import Inference
    monkeypatch.setenv("SAM3D_TEST_EVIL_TARGET", "os.system")
    folder, marker, victim = _hostile_folder(tiny, tmp_path, name)
    with pytest.raises(ConfigError):
        Inference(folder / "pipeline.yaml", device="cpu")
    _assert_untouched(marker, victim)


@pytest.mark.parametrize("name", ["oc_create", "torch_load_weights_only_false", "reexport_rmtree"])
def test_hostile_config_safe_instantiate_directly(tiny, tmp_path, name):
    """The lower-level entry points refuse the same trees (a caller that skips Inference's folder check)."""
    from sam3d_objects.config.instantiate import safe_instantiate
    folder, marker, victim = _hostile_folder(tiny, tmp_path, name)
    config = OmegaConf.load(folder / "pipeline.yaml")
    with pytest.raises(UnsafeConfigError):
        safe_instantiate(config.ss_preprocessor if name != "torch_load_weights_only_false" else
                         config.layout_post_optimization_method)
    _assert_untouched(marker, victim)


def test_secret_from_env_is_never_echoed(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SAM3D_TEST_SECRET_TOKEN", "hunter2-secret-value")
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    config = OmegaConf.load(folder / "pipeline.yaml")
    config.ss_decoder_ckpt_path = "${oc.env:SAM3D_TEST_SECRET_TOKEN}/ss_decoder.ckpt"
    OmegaConf.save(config, folder / "pipeline.yaml")
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "out"), "--checkpoints",
                     str(folder), "--pointmap", "flat", "--no-progress", "--debug"])
    captured = capsys.readouterr()
    assert code == cli.EXIT_CHECKPOINT
    assert "hunter2" not in captured.err + captured.out
    assert "oc.env" in captured.err and "ss_decoder_ckpt_path" in captured.err


def test_plain_interpolations_still_work(tmp_path):
    (tmp_path / "a.yaml").write_text("size: 518\nnode:\n  _target_: torchvision.transforms.Resize\n"
                                     "  size: ${size}\nrel: ${.size}\n")
    config = load_checkpoint_yaml(tmp_path / "a.yaml")
    assert config.node.size == 518 and config.rel == 518


BILLION_LAUGHS = ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                  "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                  "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
                  "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]\n"
                  "i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]\n")


def test_billion_laughs_refused_in_milliseconds(tiny, tmp_path, capsys):
    start = time.perf_counter()
    with pytest.raises(UnsafeConfigError, match="expands to over"):
        check_yaml_text(BILLION_LAUGHS)
    assert time.perf_counter() - start < 2.0
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    (folder / "pipeline.yaml").write_text(BILLION_LAUGHS)
    start = time.perf_counter()
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "out"), "--checkpoints",
                     str(folder), "--pointmap", "flat", "--no-progress"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CHECKPOINT and "expands to over" in err and "Traceback" not in err
    assert time.perf_counter() - start < 10.0


@pytest.mark.parametrize("text,match", [("[" * 5000 + "]" * 5000, "nested"), ("a: " + "[" * 100 + "]" * 100, "nested"),
                                        ("a: &a [*a]\n", "alias|not valid"), ("", "empty"),
                                        ("- 1\n- 2\n", "mapping")])
def test_degenerate_yaml_refused(tmp_path, text, match):
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(UnsafeConfigError, match=match):
        load_checkpoint_yaml(tmp_path / "p.yaml")


def test_planted_moge_package_is_never_imported(tiny, tmp_path, monkeypatch):
    """A ``moge/`` folder inside the checkpoint folder, with the folder first on sys.path (as when the CLI runs
    there through ``python -m``): loading the folder's yaml marks it untrusted, and the import is refused."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    marker = tmp_path / "MARKER"
    (folder / "moge").mkdir()
    (folder / "moge" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "moge", raising=False)
    load_checkpoint_yaml(folder / "pipeline.yaml")
    with pytest.raises(UnsafeConfigError, match="inside the checkpoint folder"):
        trusted_import("moge.model.v1")
    assert not marker.exists()


def test_planted_moge_package_cli_subprocess(tiny, tmp_path):
    """The real route: ``python -m sam3d_objects.cli`` run from inside the checkpoint folder, no --pointmap (the
    depth model is needed), pipeline.yaml configuring MoGe as released."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    marker = tmp_path / "MARKER"
    for package in ("moge", "backends", "argparse"):
        (folder / package).mkdir()
        (folder / package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    config = OmegaConf.load(folder / "pipeline.yaml")
    config.depth_model = {"_target_": "sam3d_objects.pipeline.depth_models.moge.MoGe",
                          "model": {"_target_": "moge.model.v1.MoGeModel.from_pretrained",
                                    "pretrained_model_name_or_path": "Ruicheng/moge-vitl"}}
    OmegaConf.save(config, folder / "pipeline.yaml")
    env = dict(os.environ, PYTHONPATH=root_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "sam3d_objects.cli", "reconstruct", IMAGE, "--mask", MASK0,
                           "--out", str(tmp_path / "out"), "--checkpoints", ".", "--steps", "1", "--no-progress"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert not marker.exists(), proc.stderr
    assert proc.returncode in (cli.EXIT_INPUT, cli.EXIT_CHECKPOINT), proc.stderr
    assert "Traceback" not in proc.stderr


def test_released_configs_pass(tiny):
    """The shipped tiny configs (same targets as the released ones) load and check; and, where ../shared is
    present, the released yamls and every golden case config name only registered targets."""
    from sam3d_objects.config.safety import REGISTERED_TARGETS, check_config_tree, iter_target_nodes
    for yaml in sorted(tiny.glob("*.yaml")):
        load_checkpoint_yaml(yaml)
    shared = ROOT.parent / "shared" / "upstream_configs"
    if shared.is_dir():
        for yaml in sorted(shared.glob("*.yaml")):
            config = load_checkpoint_yaml(yaml)
            check_config_tree(config)
            assert all(str(node["_target_"]) in REGISTERED_TARGETS for _, node in iter_target_nodes(config))


def test_upstream_helpers_are_stricter():
    """upstream's check_target keeps its behaviour for plain model classes and also refuses re-exports of
    file / process / pickle functions under whitelisted prefixes."""
    from sam3d_objects.inference import BLACKLIST_FILTERS, WHITELIST_FILTERS, check_hydra_safety, check_target
    check_target("torch.nn.Linear", WHITELIST_FILTERS, BLACKLIST_FILTERS)
    check_target("sam3d_objects.config.utils.make_dict", WHITELIST_FILTERS, BLACKLIST_FILTERS)
    for bad in ("sam3d_objects.reconstruction.shutil.rmtree", "sam3d_objects.pipeline.checkpoint.torch.load",
                "sam3d_objects.reconstruction.np.load", "sam3d_objects.reconstruction.Path.write_text",
                "sam3d_objects.reconstruction.shutil.copyfile",
                "sam3d_objects.validation.os.system", "torch.load", "torch.hub.load", "sam3d_objects.cli.main",
                "torch.utils.cpp_extension.load_inline"):
        with pytest.raises(RuntimeError, match="is not allowed to be hydra instantiated"):
            check_target(bad, WHITELIST_FILTERS, BLACKLIST_FILTERS)
    with pytest.raises(RuntimeError, match="oc.create"):
        check_hydra_safety(OmegaConf.create({"a": "${oc.create:{_target_: os.system}}"}), WHITELIST_FILTERS,
                           BLACKLIST_FILTERS)


def test_weights_only_is_forced_in_every_loader(tmp_path):
    """The checkpoint readers never unpickle code whatever the file holds (a guard against a future edit)."""
    from sam3d_objects.pipeline.checkpoint import CheckpointError, read_checkpoint
    marker = tmp_path / "MARKER"
    torch.save({"w": torch.zeros(1), "evil": _Payload(str(marker))}, tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError):
        read_checkpoint(tmp_path / "evil.ckpt")
    assert not marker.exists()
