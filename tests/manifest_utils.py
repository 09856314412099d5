"""Shared helpers for the manifest tests: full-size models built on the meta device vs the checkpoint manifests."""
import json

import pytest
import torch
from hydra.utils import instantiate

from conftest import GOLDEN, ROOT, SHARED  # noqa: F401  (ROOT: re-exported)

CONFIGS = SHARED / "upstream_configs"
MANIFESTS = GOLDEN / "manifests"


def require_shared(config: str) -> None:
    if not (CONFIGS / f"{config}.yaml").exists() or not (MANIFESTS / f"{config}.json").exists():
        pytest.skip(f"upstream configs / manifests not found under {SHARED}")


def build_on_meta(node):
    with torch.device("meta"):
        return instantiate(node)


def manifest(name: str) -> dict:
    return json.loads((MANIFESTS / f"{name}.json").read_text())


def manifest_entries(name: str, prefix: str = ""):
    return [(e["key"][len(prefix):], tuple(e["shape"]), e["dtype"]) for e in manifest(name)["keys"]
            if e["key"].startswith(prefix)]


def state_entries(module: torch.nn.Module):
    return [(k, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in module.state_dict().items()]


def assert_same_entries(actual, expected, what: str) -> None:
    actual_keys, expected_keys = [a[0] for a in actual], [e[0] for e in expected]
    missing = sorted(set(expected_keys) - set(actual_keys))
    unexpected = sorted(set(actual_keys) - set(expected_keys))
    assert not missing and not unexpected, f"{what}: missing {missing[:8]} unexpected {unexpected[:8]}"
    wrong = [(a, e) for a, e in zip(sorted(actual), sorted(expected)) if a != e]
    assert not wrong, f"{what}: shape/dtype differ, e.g. {wrong[:5]}"
    assert actual_keys == expected_keys, f"{what}: same keys, different state_dict() order"
