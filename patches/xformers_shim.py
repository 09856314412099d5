"""``xformers.ops`` stand-in: ``memory_efficient_attention`` (with ``fmha.BlockDiagonalMask``) through
``backends``. q/k/v are [B, L, H, D]; with a block-diagonal mask B is 1 and the sequences are packed along L."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._modules import drop, install_shim, make


class BlockDiagonalMask:
    """Sequences packed along the token axis attend only within themselves."""

    def __init__(self, q_seqlen: Sequence[int], kv_seqlen: Sequence[int]):
        if len(q_seqlen) != len(kv_seqlen):
            raise ValueError("q_seqlen and kv_seqlen must list the same number of sequences")
        self.q_seqlen, self.kv_seqlen = [int(n) for n in q_seqlen], [int(n) for n in kv_seqlen]

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Optional[Sequence[int]] = None) -> "BlockDiagonalMask":
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen)


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


def memory_efficient_attention(query, key, value, attn_bias=None, p: float = 0.0, scale=None, **unused):
    import backends

    if p:
        raise NotImplementedError("xformers shim: dropout (p > 0) is not supported (inference only)")
    if attn_bias is None:
        return backends.attention(query, key, value, scale=scale)
    if not isinstance(attn_bias, BlockDiagonalMask):
        raise NotImplementedError(f"xformers shim: attn_bias {type(attn_bias).__name__} is not supported "
                                  "(None or fmha.BlockDiagonalMask)")
    if query.shape[0] != 1:
        raise ValueError("with a BlockDiagonalMask, sequences are packed along dim 1 and the batch must be 1")
    out = backends.varlen_attention(query[0], key[0], value[0], _cu(attn_bias.q_seqlen, query.device),
                                    _cu(attn_bias.kv_seqlen, query.device), max(attn_bias.q_seqlen, default=0),
                                    max(attn_bias.kv_seqlen, default=0), scale=scale)
    return out[None]


def _build():
    fmha = make("xformers.ops.fmha", __doc__, BlockDiagonalMask=BlockDiagonalMask,
                memory_efficient_attention=memory_efficient_attention)
    ops = make("xformers.ops", __doc__, fmha=fmha, memory_efficient_attention=memory_efficient_attention)
    root = make("xformers", __doc__, ops=ops, __version__="0.0+sam3d-shim")
    return [root, ops, fmha]


def install(replace_installed: bool = False) -> str:
    return install_shim("xformers", _build, replace_installed)


def uninstall() -> None:
    drop("xformers", only_shims=True)
