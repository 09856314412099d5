"""The Metal sparse-conv backend (``SPARSE_BACKEND=metal``, Apple GPUs): an implicit-GEMM kernel
(``backends/metal/sparse_conv.metal``) compiled and launched through the shared Metal runtime (``backends.metal``).

The neighbour map itself is built with torch ops (sort + searchsorted run on MPS); only its int32 table and a
row order by neighbour mask are derived here, once per map.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import metal as shaders
from ..hashing import NeighborMap, neighbor_map as _neighbor_map
from ..registry import Family, register

# Tile shapes: these must match the #defines in backends/metal/sparse_conv.metal.
CONV_TILE_ROWS, CONV_TILE_COLS, CONV_GROUP = 32, 64, (16, 16)
# Threadgroup memory the kernel declares (bytes, from the tile #defines; fp32 tiles).
CONV_THREADGROUP_BYTES = 4 * (16 * (CONV_TILE_ROWS + 1) + 16 * CONV_TILE_COLS + CONV_TILE_ROWS + 1)


def conv_row_order(nmap: NeighborMap) -> dict:
    """Rows ordered by their neighbour bit masks (rows with the same offsets share tiles, so whole offsets are
    skipped per tile) and the neighbour table as int32 in that order."""
    table = nmap.table
    k = table.shape[1]
    if k <= 31:  # int32 masks: the widest integer type every MPS op here supports
        bits = torch.ones(k, dtype=torch.int32, device=table.device) << torch.arange(k, dtype=torch.int32,
                                                                                      device=table.device)
        masks = ((table >= 0).to(torch.int32) * bits).sum(dim=1, dtype=torch.int32)
        try:
            order = torch.argsort(masks, stable=True)  # keeps spatial order within a mask: better locality
        except RuntimeError:  # a stable sort is only a locality nicety
            order = torch.argsort(masks)
    else:
        order = torch.arange(table.shape[0], device=table.device)
    return {"order": order.to(torch.int32).contiguous(), "table": table[order].to(torch.int32).contiguous()}


def conv_launches(n_rows: int, cin: int, cout: int, k_vol: int) -> list[tuple[int, int]]:
    """(first row tile, row tiles) of each launch, each bounded by ``backends.metal.LAUNCH_WORK_LIMIT``."""
    tiles = -(-n_rows // CONV_TILE_ROWS)
    per_tile = CONV_TILE_ROWS * k_vol * cin * max(cout, 1)
    step = max(1, shaders.LAUNCH_WORK_LIMIT // per_tile)
    return [(t, min(step, tiles - t)) for t in range(0, tiles, step)]


def metal_sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, nmap: Optional[NeighborMap] = None) -> torch.Tensor:
    """Submanifold convolution (see ``backends.sparse_conv3d``) with the implicit-GEMM Metal kernel."""
    k = weight.shape[1]
    nmap = nmap if nmap is not None else _neighbor_map(coords, k)
    kernel, work = shaders.kernel_for("sparse_conv", "sparse_conv", feats.dtype)
    n, cin = feats.shape
    cout, k_vol = weight.shape[0], k ** 3
    prep = nmap.extra("metal_conv_order", conv_row_order)
    x = feats.to(work).contiguous()
    w = weight.to(work).contiguous()  # [Cout, k, k, k, Cin] is read as [Cout, K, Cin]: no permute
    b = bias.to(work).contiguous() if bias is not None else w  # any buffer; has_bias=0 keeps it unread
    out = torch.empty((n, cout), dtype=work, device=feats.device)
    col_tiles = -(-cout // CONV_TILE_COLS)
    gx, gy = CONV_GROUP
    meter = shaders.WorkMeter(feats.device)
    for tile0, tiles in conv_launches(n, cin, cout, k_vol):
        meter.add(tiles * CONV_TILE_ROWS * k_vol * cin * cout)
        kernel(x, prep["table"], prep["order"], w, b, out, n, cin, cout, k_vol, int(bias is not None), tile0,
               threads=[gx * col_tiles, gy * tiles], group_size=[gx, gy])
    return out if work == feats.dtype else out.to(feats.dtype)


_conv_probe = shaders.probe_for("sparse_conv", "sparse_conv", CONV_GROUP[0] * CONV_GROUP[1], CONV_THREADGROUP_BYTES)
# `lean`: on unified memory the portable lean / child-block paths' bounded working set beats materialising input.
register(Family.SPARSE_CONV, "metal", devices=("mps",), dtypes=shaders.DTYPES, probe=_conv_probe, priority=30,
         warn_when_skipped=True, lean=True)(metal_sparse_conv3d)
