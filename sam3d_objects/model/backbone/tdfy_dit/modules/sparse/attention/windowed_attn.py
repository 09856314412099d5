"""Swin-style windowed self-attention on sparse voxels (windows of `window_size`^3 cells, optional shift)."""
import math
from typing import Tuple, Union

import torch

import backends

from ..basic import SparseTensor

__all__ = ["calc_window_partition", "sparse_windowed_scaled_dot_product_self_attention"]


def _per_axis(value: Union[int, Tuple[int, ...]], dims: int) -> Tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * dims


def calc_window_partition(tensor: SparseTensor, window_size: Union[int, Tuple[int, ...]],
                          shift_window: Union[int, Tuple[int, ...]] = 0):
    """Group voxels into windows.

    Coords are shifted by +shift_window; window id = (batch, floor(c / window_size)) linearised as
    b*NWx*NWy*NWz + wx*NWy*NWz + wy*NWz + wz with NW = ceil((max shifted coord + 1) / window_size).

    Returns (fwd_indices [N] int64: voxel rows grouped by window in window-code order, bwd_indices [N] int64: its
    inverse permutation, seq_lens [W] int64: sizes of the non-empty windows, seq_batch_indices [W] int64).
    """
    dims = tensor.coords.shape[1] - 1
    window = _per_axis(window_size, dims)
    shift = _per_axis(shift_window, dims)
    device = tensor.device
    n = tensor.coords.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty.clone(), empty.clone(), empty.clone()
    coords = tensor.coords.long()
    shifted = coords[:, 1:] + torch.tensor(shift, dtype=torch.int64, device=device)
    num_windows = [math.ceil((m + 1) / w) for m, w in zip(shifted.max(dim=0).values.tolist(), window)]
    cell = torch.div(shifted, torch.tensor(window, dtype=torch.int64, device=device), rounding_mode="floor")
    code = coords[:, 0]
    for axis in range(dims):
        code = code * num_windows[axis] + cell[:, axis]
    # the default (unstable) sort, as upstream: the order inside a window does not change the maths, but it is the
    # order in which attention sums, so the same sort reproduces upstream's float32 rounding on the CPU
    fwd_indices = backends.argsort(code)
    bwd_indices = torch.empty_like(fwd_indices)
    bwd_indices[fwd_indices] = torch.arange(n, dtype=torch.int64, device=device)
    unique_code, seq_lens = torch.unique_consecutive(code[fwd_indices], return_counts=True)
    per_batch = math.prod(num_windows)
    seq_batch_indices = torch.div(unique_code, per_batch, rounding_mode="floor")
    return fwd_indices, bwd_indices, seq_lens.to(torch.int64), seq_batch_indices.to(torch.int64)


def sparse_windowed_scaled_dot_product_self_attention(qkv: SparseTensor, window_size: int,
                                                      shift_window: Union[int, Tuple[int, ...]] = (0, 0, 0)) -> SparseTensor:
    """Self-attention restricted to the voxels of one window. qkv feats [N, 3, H, D] -> [N, H, D]."""
    if qkv.feats.dim() != 4 or qkv.feats.shape[1] != 3:
        raise ValueError(f"windowed attention expects qkv feats [N, 3, H, D], got {tuple(qkv.feats.shape)}")
    key = f"window_partition_{window_size}_{shift_window}"
    cached = qkv.get_spatial_cache(key)
    if cached is None or cached[0].shape[0] != qkv.feats.shape[0]:
        cached = calc_window_partition(qkv, window_size, shift_window)
        qkv.register_spatial_cache(key, cached)
    fwd_indices, _, seq_lens, _ = cached
    if qkv.feats.shape[0] == 0:
        return qkv.replace(qkv.feats[:, 0])
    q, k, v = qkv.feats.unbind(dim=1)
    cu_key = key + "_cu_seqlens"
    cu_longest = qkv.get_spatial_cache(cu_key)
    if cu_longest is None or cu_longest[0].device != qkv.device:
        # cached with the partition: reading the longest window is a device sync, once per coordinate set
        cu = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)]).to(torch.int32)
        cu_longest = (cu, int(seq_lens.max()))
        qkv.register_spatial_cache(cu_key, cu_longest)
    cu, longest = cu_longest
    # the windows' tokens are the rows fwd_indices of qkv: the backend gathers them (no sorted copy of qkv) and
    # returns the output in the voxels' own order
    out = backends.varlen_attention(q, k, v, cu, cu, longest, longest, rows=fwd_indices)
    return qkv.replace(out)
