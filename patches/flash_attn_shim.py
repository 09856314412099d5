"""``flash_attn`` (FA2) and ``flash_attn_interface`` (FA3) stand-ins: their functional APIs through
``backends.attention`` / ``backends.varlen_attention``.

Non-causal attention without dropout (inference) is provided; ``causal=True`` or ``dropout_p > 0`` raise.
FA3's ``flash_attn_func`` accepts float8 inputs as on Hopper: they are computed in float32 and the output is
bfloat16 (FA3's fp8 output dtype).
"""
from __future__ import annotations

import torch

from ._modules import drop, install_shim, make


def _check(dropout_p: float, causal: bool, name: str) -> None:
    if causal or dropout_p:
        raise NotImplementedError(f"flash_attn shim: {name} supports causal=False and dropout_p=0 (inference); "
                                  "install flash_attn on CUDA for training")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **unused):
    import backends

    _check(dropout_p, causal, "flash_attn_func")
    return backends.attention(q, k, v, scale=softmax_scale)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, **unused):
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, **unused):
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **unused):
    import backends

    _check(dropout_p, causal, "flash_attn_varlen_func")
    return backends.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     scale=softmax_scale)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, **unused):
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, **unused):
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal)


_FUNCTIONS = dict(flash_attn_func=flash_attn_func, flash_attn_qkvpacked_func=flash_attn_qkvpacked_func,
                  flash_attn_kvpacked_func=flash_attn_kvpacked_func, flash_attn_varlen_func=flash_attn_varlen_func,
                  flash_attn_varlen_qkvpacked_func=flash_attn_varlen_qkvpacked_func,
                  flash_attn_varlen_kvpacked_func=flash_attn_varlen_kvpacked_func)


def fa3_flash_attn_func(q, k, v, softmax_scale=None, causal=False, **unused):
    """FA3's ``flash_attn_interface.flash_attn_func``: [B, L, H, D] -> [B, L, H, D] (the output only)."""
    fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8:
        q, k, v = q.float(), k.float(), v.float()
    out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return out.to(torch.bfloat16) if fp8 else out


def fa3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False, **unused):
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=softmax_scale, causal=causal)


def _build_fa3():
    return [make("flash_attn_interface", __doc__, flash_attn_func=fa3_flash_attn_func,
                 flash_attn_varlen_func=fa3_flash_attn_varlen_func)]


def _build():
    interface = make("flash_attn.flash_attn_interface", __doc__, **_FUNCTIONS)
    root = make("flash_attn", __doc__, flash_attn_interface=interface, __version__="2.0+sam3d-shim", **_FUNCTIONS)
    return [root, interface]


def install(replace_installed: bool = False) -> str:
    """"shim" when either FA2 or FA3 was stood in for, else "real"."""
    states = {install_shim("flash_attn", _build, replace_installed),
              install_shim("flash_attn_interface", _build_fa3, replace_installed)}
    return "shim" if "shim" in states else "real"


def uninstall() -> None:
    drop("flash_attn", only_shims=True)
    drop("flash_attn_interface", only_shims=True)
