"""Device helpers for MPS: memory budgets sized from the MPS recommended working set, and a real (sampled)
peak for MPS instead of the current allocation. MPS itself is faked: no Apple hardware here."""
import itertools
import time

import backends
import backends.attn as attn
import backends.device as dev
import torch


def test_budget_is_the_fixed_default_off_mps():
    assert dev.memory_budget("cpu") == 512 * 2 ** 20
    assert dev.recommended_max_memory("cpu") is None
    assert backends.max_attention_bytes(torch.device("cpu")) == 512 * 2 ** 20


def test_budget_follows_the_recommended_working_set_on_mps(monkeypatch):
    monkeypatch.delenv("SAM3D_ATTN_MAX_MB", raising=False)
    for recommended, want in ((16 * 2 ** 30, 2 ** 30), (96 * 2 ** 30, 6 * 2 ** 30), (2 ** 30, 128 * 2 ** 20)):
        monkeypatch.setattr(dev, "recommended_max_memory", lambda d, r=recommended: r if d.type == "mps" else None)
        assert dev.memory_budget(torch.device("mps")) == want
        assert attn.max_attention_bytes(torch.device("mps")) == want
    monkeypatch.setenv("SAM3D_ATTN_MAX_MB", "100")  # an explicit setting wins
    assert attn.max_attention_bytes(torch.device("mps")) == 100 * 2 ** 20


def test_sampled_peak_catches_a_spike_between_reads():
    values = itertools.chain([10, 10, 500, 20], itertools.repeat(20))  # a short spike, gone at the end
    dev.start_peak_sampling("fake", lambda: next(values), interval=0.001)
    time.sleep(0.05)
    assert dev.stop_peak_sampling("fake") == 500
    assert dev.stop_peak_sampling("fake") is None
