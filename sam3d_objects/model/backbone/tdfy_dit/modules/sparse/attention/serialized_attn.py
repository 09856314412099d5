"""Serialized sparse self-attention: voxels ordered along a space-filling curve (z-order or Hilbert, optionally
with x/y swapped), cut into windows of `window_size` consecutive voxels (cyclically padded, optionally shifted),
attention inside each window. The curve codes are `backends.curves` (upstream uses the CUDA `vox2seq`)."""
import math
from enum import Enum
from typing import Tuple

import torch

import backends

from ..basic import SparseTensor

__all__ = ["sparse_serialized_scaled_dot_product_self_attention"]


class SerializeMode(Enum):
    Z_ORDER = 0
    Z_ORDER_TRANSPOSED = 1
    HILBERT = 2
    HILBERT_TRANSPOSED = 3


SerializeModes = [SerializeMode.Z_ORDER, SerializeMode.Z_ORDER_TRANSPOSED, SerializeMode.HILBERT,
                  SerializeMode.HILBERT_TRANSPOSED]


def _curve_codes(coords: torch.Tensor, mode: SerializeMode, shift_window: Tuple[int, int, int]) -> torch.Tensor:
    xyz = coords[:, 1:].long() + torch.tensor(shift_window, device=coords.device, dtype=torch.long)
    if mode in (SerializeMode.Z_ORDER_TRANSPOSED, SerializeMode.HILBERT_TRANSPOSED):
        xyz = xyz[:, [1, 0, 2]]
    bits = max(1, int(xyz.max()).bit_length()) if xyz.numel() else 1
    if mode in (SerializeMode.Z_ORDER, SerializeMode.Z_ORDER_TRANSPOSED):
        return backends.curves.z_order_encode(xyz, bits)
    return backends.curves.hilbert_encode(xyz, bits)


def calc_serialization(tensor: SparseTensor, window_size: int, serialize_mode: SerializeMode = SerializeMode.Z_ORDER,
                       shift_sequence: int = 0, shift_window: Tuple[int, int, int] = (0, 0, 0)):
    """(fwd_indices, bwd_indices, seq_lens, seq_batch_indices): gather order of the windows' voxels, the position
    of every voxel's output inside the gathered sequence, window lengths and their batch index."""
    codes = _curve_codes(tensor.coords, serialize_mode, tuple(shift_window))
    fwd, bwd, seq_lens, seq_batch = [], [], [], []
    offset = 0
    device = tensor.coords.device
    for b, rows in enumerate(tensor.layout):
        start, n = rows.start, rows.stop - rows.start
        if n == 0:
            continue
        order = torch.argsort(codes[rows]) + start
        num_windows = math.ceil(n / window_size)
        if num_windows == 1:
            fwd.append(order)
            back = torch.empty(n, dtype=torch.long, device=device)
            back[order - start] = torch.arange(n, device=device) + offset
            bwd.append((back, start))
            seq_lens.append(n)
            seq_batch.append(b)
            offset += n
            continue
        valid = n / num_windows
        back = torch.empty(n, dtype=torch.long, device=device)
        for i in range(num_windows):
            mid = (i + 0.5) * valid + shift_sequence
            lo, hi = math.floor(i * valid + shift_sequence), math.floor((i + 1) * valid + shift_sequence)
            first = math.floor(mid - window_size / 2)
            idx = torch.arange(first, first + window_size, device=device) % n
            fwd.append(order[idx])
            # the voxels of the valid range read their output from their slot in this padded window
            valid_pos = torch.arange(lo, hi, device=device)
            back[order[valid_pos % n] - start] = offset + (valid_pos - first)
            seq_lens.append(window_size)
            seq_batch.append(b)
            offset += window_size
        bwd.append((back, start))
    bwd_indices = torch.empty(tensor.coords.shape[0], dtype=torch.long, device=device)
    for back, start in bwd:
        bwd_indices[start:start + back.shape[0]] = back
    return (torch.cat(fwd) if fwd else torch.zeros(0, dtype=torch.long, device=device), bwd_indices,
            torch.tensor(seq_lens, dtype=torch.int64, device=device),
            torch.tensor(seq_batch, dtype=torch.int64, device=device))


def sparse_serialized_scaled_dot_product_self_attention(qkv: SparseTensor, window_size: int,
                                                        serialize_mode: SerializeMode = SerializeMode.Z_ORDER,
                                                        shift_sequence: int = 0,
                                                        shift_window: Tuple[int, int, int] = (0, 0, 0)
                                                        ) -> SparseTensor:
    """Self-attention inside serialized windows. qkv feats [N, 3, H, C] -> [N, H, C]."""
    if qkv.feats.dim() != 4 or qkv.feats.shape[1] != 3:
        raise ValueError(f"serialized attention expects qkv feats [N, 3, H, C], got {tuple(qkv.feats.shape)}")
    key = f"serialization_{serialize_mode}_{window_size}_{shift_sequence}_{shift_window}"
    cached = qkv.get_spatial_cache(key)
    if cached is None:
        cached = calc_serialization(qkv, window_size, serialize_mode, shift_sequence, shift_window)
        qkv.register_spatial_cache(key, cached)
    fwd_indices, bwd_indices, seq_lens, _ = cached
    q, k, v = qkv.feats[fwd_indices].unbind(dim=1)
    cu = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)]).to(torch.int32)
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    out = backends.varlen_attention(q, k, v, cu, cu, longest, longest)
    return qkv.replace(out[bwd_indices])
