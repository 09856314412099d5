"""``flash_attn`` stand-in: its functional API through ``backends.attention`` / ``backends.varlen_attention``.

Non-causal attention without dropout (inference) is provided; ``causal=True`` or ``dropout_p > 0`` raise.
"""
from __future__ import annotations

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


def _build():
    interface = make("flash_attn.flash_attn_interface", __doc__, **_FUNCTIONS)
    root = make("flash_attn", __doc__, flash_attn_interface=interface, __version__="2.0+sam3d-shim", **_FUNCTIONS)
    return [root, interface]


def install(replace_installed: bool = False) -> str:
    return install_shim("flash_attn", _build, replace_installed)


def uninstall() -> None:
    drop("flash_attn", only_shims=True)
