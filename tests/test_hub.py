"""Weights by name: a fake Hugging Face cache (the tiny checkpoint laid out as the hub lays it out) loaded offline
through the real code: huggingface_hub's snapshot_download, our file selection, the checkpoint checks and the
safe config loader, from the CLI (a fresh process with HF_HUB_OFFLINE=1) and from Inference.from_pretrained."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("huggingface_hub", reason="weights by name need huggingface_hub (extra `hub`)")

from sam3d_objects import cli, hub  # noqa: E402
from sam3d_objects.assets.example import EXAMPLE_DIR, example_pointmap  # noqa: E402
from tests.hub_cache import add_snapshot, repo_folder  # noqa: E402
from conftest import root_pythonpath  # noqa: E402

REPO = "test-org/tiny-sam3d"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


@pytest.fixture()
def cache(tmp_path, tiny, monkeypatch):
    """A hub cache holding REPO at main (plus a file the pipeline does not need), offline for this process."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, tiny, extra={"README.md": b"# tiny\n", "checkpoints/unused_extra.ckpt": b"x" * 10})
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # both read by huggingface_hub at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def offline_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "hf_home"),
               PYTHONPATH=root_pythonpath(), OMP_NUM_THREADS="1")
    return env


def test_repo_id_detection(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.looks_like_repo_id("facebook/sam-3d-objects")
    assert not hub.looks_like_repo_id("sam-3d-objects")          # no org: a folder name
    assert not hub.looks_like_repo_id("./ckpt/hf") and not hub.looks_like_repo_id("/abs/path")
    assert not hub.looks_like_repo_id("a/b/c") and not hub.looks_like_repo_id("ckpt/pipeline.yaml")
    (tmp_path / "local" / "hf").mkdir(parents=True)
    assert not hub.looks_like_repo_id("local/hf")                  # an existing folder always wins


def test_referenced_files_are_what_the_pipeline_names(tiny):
    names = hub.referenced_files(tiny / "pipeline.yaml")
    assert "ss_generator.ckpt" in names and "slat_decoder_mesh.yaml" in names
    assert all((tiny / n).is_file() for n in names)
    assert not any(n.endswith("RECIPE.json") for n in names)


def test_download_only_needed_files_then_load(cache, tiny, monkeypatch):
    """snapshot_download is called with the yamls first, then exactly the files pipeline.yaml names."""
    import huggingface_hub
    calls = []
    real = huggingface_hub.snapshot_download

    def recording(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    config = hub.download_checkpoint(REPO)
    assert config.name == "pipeline.yaml" and config.parent.name == "checkpoints"
    assert repo_folder(cache, REPO) in config.parents
    assert calls[0]["allow_patterns"] == ["*.yaml", "*.yml"]
    wanted = sorted(f"checkpoints/{n}" for n in hub.referenced_files(tiny / "pipeline.yaml"))
    assert sorted(calls[1]["allow_patterns"]) == wanted
    assert "checkpoints/unused_extra.ckpt" not in calls[1]["allow_patterns"]
    assert all(c["revision"] is None for c in calls)


def test_from_pretrained_offline(cache):
    from sam3d_objects.inference import Inference
    inference = Inference.from_pretrained(REPO, device="cpu", low_memory=True)
    example = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(EXAMPLE_DIR / "image.png").convert("RGB"))
    mask = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(EXAMPLE_DIR / "0.png")) > 0
    out = inference(example, mask[..., 0] if mask.ndim == 3 else mask, seed=1, pointmap=example_pointmap(),
                    stage1_inference_steps=1, stage2_inference_steps=1, decode_formats=["gaussian"])
    assert out["gs"].get_xyz.shape[0] > 0


def test_revision_selects_the_snapshot(cache, tiny):
    other = add_snapshot(cache, REPO, tiny, ref="v1", commit="1" * 40)
    assert hub.download_checkpoint(REPO, revision="v1") == other / "checkpoints" / "pipeline.yaml"
    assert hub.download_checkpoint(REPO, revision="1" * 40) == other / "checkpoints" / "pipeline.yaml"
    main = hub.download_checkpoint(REPO)
    assert main != other / "checkpoints" / "pipeline.yaml"


def test_offline_missing_repo_and_partial_cache(cache, tiny):
    with pytest.raises(hub.HubError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        hub.download_checkpoint("test-org/never-downloaded")
    add_snapshot(cache, "test-org/partial", tiny, skip=("ss_generator.ckpt",))
    with pytest.raises(hub.HubError, match=r"checkpoints/ss_generator.ckpt not in the Hugging Face cache \(offline"):
        hub.download_checkpoint("test-org/partial")


def _http_error(cls, status):
    import httpx
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
    return cls(f"{status} error", response=response)


@pytest.mark.parametrize("kind", ["GatedRepoError", "RepositoryNotFoundError"])
def test_gated_or_missing_repo_is_one_line_naming_the_licence(monkeypatch, kind, capsys, tmp_path):
    import huggingface_hub
    from huggingface_hub import errors
    error = _http_error(getattr(errors, kind), 403 if kind == "GatedRepoError" else 404)

    def refuse(**kwargs):
        raise error
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(hub.HubError) as info:
        hub.download_checkpoint(hub.OFFICIAL_REPO)
    message = str(info.value)
    assert "\n" not in message and hub.LICENCE_PAGE in message and "hf auth login" in message
    code = cli.main(["reconstruct", str(EXAMPLE_DIR / "image.png"), "--mask", str(EXAMPLE_DIR / "0.png"),
                     "--out", str(tmp_path / "o"), "--checkpoints", hub.OFFICIAL_REPO])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CHECKPOINT and hub.LICENCE_PAGE in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_cli_reconstructs_from_repo_id_offline(cache, tmp_path):
    """A fresh process, HF_HUB_OFFLINE=1: the repo id resolves to the cached snapshot and the run completes."""
    pm = tmp_path / "pm.npy"
    np.save(pm, example_pointmap())
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "sam3d_objects.cli", "reconstruct", str(EXAMPLE_DIR / "image.png"),
                           "--mask", str(EXAMPLE_DIR / "0.png"), "--out", str(out), "--checkpoints", REPO,
                           "--pointmap", str(pm), "--steps", "1", "--no-progress", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, env=offline_env(cache), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert str(repo_folder(cache, REPO)) in summary["checkpoint"]
    assert (out / "splat.ply").is_file() and (out / "mesh.glb").is_file()


def test_downloaded_folder_is_untrusted(cache, tiny, tmp_path, capsys):
    """A repo whose pipeline.yaml names a target outside the allow-list is refused by the same loader as a local
    folder (exit 3), and nothing of it runs."""
    marker = tmp_path / "pwned"
    text = (tiny / "pipeline.yaml").read_text()
    evil = {"checkpoints/pipeline.yaml": text.replace(
        text.splitlines()[0], f"_target_: os.system\ncommand: touch {marker}", 1).encode()}
    add_snapshot(cache, "test-org/evil", tiny, skip=("pipeline.yaml",), extra=evil)
    code = cli.main(["reconstruct", str(EXAMPLE_DIR / "image.png"), "--mask", str(EXAMPLE_DIR / "0.png"),
                     "--out", str(tmp_path / "o"), "--checkpoints", "test-org/evil", "--pointmap", "flat"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CHECKPOINT and "os.system" in err, err
    assert not marker.exists()
