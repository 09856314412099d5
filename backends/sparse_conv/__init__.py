"""Submanifold sparse 3D convolution: the one dispatch entry point, :func:`sparse_conv3d`, and its backends.

Rule (spconv's, pinned by the golden ``sparse_ops`` case): output rows are the input rows, and
``out[p] = bias + sum_k W[:, kx, ky, kz, :] @ in[p + (kx - r, ky - r, kz - r)]`` over neighbours present in the
same batch element, with ``W`` in spconv's ``[Cout, kx, ky, kz, Cin]`` layout and ``r = k // 2``.

Kernel size 1 is the exception: spconv runs it as a plain matmul that reads the ``[Cout, 1, 1, 1, Cin]`` buffer
as a ``[Cin, Cout]`` matrix (no transpose), and checkpoints were trained with that reading, so
``out = in @ W.reshape(Cin, Cout) + bias``. Every backend shares this through :func:`sparse_conv3d`.

Backends, one module each, registered when this package is imported: ``portable`` (``torch``: gather-GEMM-scatter,
plus the memory-lean and child-block paths for subdivided input, described there), ``spconv``, ``torchsparse``,
``triton`` (CUDA implicit GEMM) and ``metal`` (Apple GPUs). The dispatcher reads each backend's capabilities
(``lean``), never its name.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..device import matmul_input_dtype
from ..hashing import CoordHash, NeighborMap, check_coords, neighbor_map as coords_neighbor_map
from ..registry import Family, resolve
from .portable import (FLOAT_DTYPES, blocked_sparse_conv3d, blocked_sparse_conv3d_chunks,  # noqa: F401
                       lean_sparse_conv3d, pointwise_conv, torch_sparse_conv3d, upsampled_sparse_conv3d,
                       upsampled_wanted, _subdivide_rows)
from .spconv import spconv_sparse_conv3d  # noqa: F401
from .torchsparse import torchsparse_sparse_conv3d  # noqa: F401
from . import metal, triton  # noqa: F401  (register their backends where they can run)


def check_conv_inputs(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> int:
    """Validate shapes/dtypes; returns the kernel size. Coordinate values (non-negative, no duplicates) are
    checked where the neighbour map is built, once per coordinate set, not at every call."""
    check_coords(coords, values=False)
    if not isinstance(feats, torch.Tensor) or feats.dim() != 2:
        raise ValueError(f"feats must be a 2-D tensor [N, Cin], got {getattr(feats, 'shape', type(feats))}")
    if not feats.dtype.is_floating_point:
        raise TypeError(f"feats must be floating point, got {feats.dtype}")
    if feats.shape[0] != coords.shape[0]:
        raise ValueError(f"feats has {feats.shape[0]} rows but coords has {coords.shape[0]}: one row per voxel")
    if weight.dim() != 5:
        raise ValueError(f"weight must be [Cout, k, k, k, Cin] (spconv layout), got {tuple(weight.shape)}")
    k = weight.shape[1]
    if weight.shape[2] != k or weight.shape[3] != k or k % 2 == 0:
        raise ValueError(f"weight must have an odd cubic kernel [Cout, k, k, k, Cin], got {tuple(weight.shape)}")
    if weight.shape[4] != feats.shape[1]:
        raise ValueError(f"weight expects {weight.shape[4]} input channels but feats has {feats.shape[1]}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [Cout={weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != feats.device:
            raise ValueError(f"{name} is on {t.device} but feats on {feats.device}; move them to one device")
    if coords.device != feats.device:
        raise ValueError(f"coords are on {coords.device} but feats on {feats.device}; move them to one device")
    return k


# A backend's ``lean`` capability: its arithmetic is what the lean / child-block paths reproduce, or (metal) its
# device profits most from their bounded working set (unified memory). For such a backend a lean or child-block
# request runs the portable ``lean_sparse_conv3d`` / ``blocked_sparse_conv3d`` on the input's device; the others
# get the materialised input.


def _check_parent_map(pmap: NeighborMap, coords: torch.Tensor) -> None:
    if 8 * pmap.num_voxels != coords.shape[0] or pmap.kernel_size != 3:
        raise ValueError(f"parent_map must be the kernel-3 map of the {coords.shape[0] // 8} parents of "
                         f"{coords.shape[0]} child coords, got {pmap.num_voxels} voxels, kernel {pmap.kernel_size}")


def sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, neighbor_map: Optional[NeighborMap] = None, *,
                  subdivided: bool = False, coord_hash: Optional[CoordHash] = None,
                  parent_map=None) -> torch.Tensor:
    """Submanifold convolution of ``feats`` [N, Cin] at ``coords`` [N, 4] (int32, b/x/y/z) -> [N, Cout].

    ``neighbor_map`` (from :func:`backends.neighbor_map`, or a zero-argument function returning one, called only
    when the chosen path needs a map) lets layers at the same coordinates share the map (``SparseTensor`` keeps
    it); without one a map is built for this call. The backend comes from ``SPARSE_BACKEND`` / ``backends.use``.

    ``subdivided=True``: ``feats`` [N, Cin] are parents of ``coords`` [8N, 4] (see
    ``backends.sparse_conv.portable``); the result has 8N rows. ``coord_hash`` (a ``CoordHash`` of ``coords``) asks for the memory-lean path and lets
    convolutions at the same coordinates share the hash; backends without a lean path ignore it.

    ``parent_map`` (the parents' kernel-3 :class:`NeighborMap`, or a zero-argument function returning it) states
    that ``coords`` are the complete child blocks of those parents (see the module docstring); the portable
    backends then convolve on the parents. Backends with their own kernels ignore it.

    Under autocast a float32 ``feats`` is convolved in autocast's dtype and the result comes back in it, as torch's
    own convolutions do (upstream's CUDA sampling runs these layers in float16; under CPU bfloat16 autocast the
    products run on the CPU's bfloat16 units, summed in float32).
    """
    feats = feats.to(matmul_input_dtype(feats.dtype, feats.device))
    if parent_map is not None and weight.dim() == 5 and weight.shape[1] == 3 and feats.shape[0]:
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.has("lean"):
            check_conv_inputs(feats, coords[::8] if subdivided else coords, weight, bias)
            pmap = parent_map() if callable(parent_map) else parent_map
            _check_parent_map(pmap, coords)
            return blocked_sparse_conv3d(feats, pmap, weight, bias, subdivided=subdivided)
    if subdivided:
        if coords.shape[0] != 8 * feats.shape[0]:
            raise ValueError(f"subdivided=True needs 8 child coords per parent row: {feats.shape[0]} parents, "
                             f"{coords.shape[0]} coords")
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if not spec.has("lean"):
            feats = _subdivide_rows(feats)
        else:
            check_conv_inputs(feats, coords[::8], weight, bias)  # one child per parent: the shapes line up
            return lean_sparse_conv3d(feats, coords, weight, bias, subdivided=True, coord_hash=coord_hash)
    elif coord_hash is not None and weight.shape[1] > 1:
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.has("lean"):
            check_conv_inputs(feats, coords, weight, bias)
            return lean_sparse_conv3d(feats, coords, weight, bias, coord_hash=coord_hash)
    k = check_conv_inputs(feats, coords, weight, bias)
    if callable(neighbor_map):
        neighbor_map = neighbor_map() if k > 1 and feats.shape[0] else None
    if weight.dtype != feats.dtype:
        weight = weight.to(feats.dtype)
    if bias is not None and bias.dtype != feats.dtype:
        bias = bias.to(feats.dtype)
    spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
    if feats.shape[0] == 0:
        return feats.new_zeros((0, weight.shape[0]))
    if k == 1:
        return pointwise_conv(feats, weight, bias)
    if neighbor_map is not None:
        _check_map(neighbor_map, feats.shape[0], k)
    return spec.fn(feats, coords, weight, bias, neighbor_map)


def _check_map(nmap: NeighborMap, voxels: int, k: int) -> None:
    if nmap.num_voxels != voxels or nmap.kernel_size != k:
        raise ValueError(f"neighbor_map is for {nmap.num_voxels} voxels and kernel {nmap.kernel_size}, "
                         f"not {voxels} voxels and kernel {k}")


def sparse_conv3d_upsampled(parent_feats: torch.Tensor, parent_index: torch.Tensor, coords: torch.Tensor,
                            weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                            neighbor_map: Optional[NeighborMap] = None) -> torch.Tensor:
    """``sparse_conv3d(parent_feats[parent_index], coords, weight, bias, neighbor_map)``: the convolution of a
    nearest-neighbour upsampling (output row i copies row ``parent_index[i]`` of ``parent_feats`` [P, Cin]; e.g.
    ``SparseUpsample``), ``coords`` [N, 4] the upsampled voxels.

    Backends with the ``lean`` capability (the portable arithmetic) convolve on the parents where there are at least
    two rows a parent (:func:`backends.sparse_conv.portable.upsampled_sparse_conv3d`): each parent times every tap's
    kernel once, then each row sums its present neighbours' parents' products; the [N, Cin] upsampled rows are never
    built. At a 2x upsampling of a shell that is about a quarter of the products of the plain convolution (a fifth
    of one GEMM over all taps) and 1 / Cin of its gathers in Cout-wide rows. The sums are the same up to float
    rounding. Other backends, kernel size 1, narrow inputs and inputs that need gradients get the upsampled rows
    (:func:`sparse_conv3d` of ``parent_feats[parent_index]``). Autocast applies as in :func:`sparse_conv3d`."""
    feats = parent_feats.to(matmul_input_dtype(parent_feats.dtype, parent_feats.device))
    if parent_index.dim() != 1 or parent_index.shape[0] != coords.shape[0]:
        raise ValueError(f"parent_index must be [N] with one parent row per voxel of coords ({coords.shape[0]}), got "
                         f"{tuple(parent_index.shape)}")
    if weight.dim() == 5 and feats.shape[0] and coords.shape[0] and upsampled_wanted(coords.shape[0], feats, weight):
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.has("lean") and weight.shape[1] > 1:
            # the parents stand in for the rows in the shape checks (fewer rows than coords: upsampled_wanted)
            k = check_conv_inputs(feats, coords[:feats.shape[0]], weight, bias)
            if callable(neighbor_map):
                neighbor_map = neighbor_map()
            if neighbor_map is None:
                neighbor_map = coords_neighbor_map(coords, k)
            _check_map(neighbor_map, coords.shape[0], k)
            return upsampled_sparse_conv3d(feats, parent_index, neighbor_map, weight, bias)
    return sparse_conv3d(feats[parent_index], coords, weight, bias, neighbor_map)


# Output rows per chunk of :func:`sparse_conv3d_chunks` on the CPU (a few tens of MB of features per chunk at the
# mesh decoder's widths). Other devices get the whole output as one chunk: their paths stay as they are.
CPU_STREAM_ROWS = 1 << 16


def stream_rows(device: torch.device) -> Optional[int]:
    """Default chunk size (output rows) of :func:`sparse_conv3d_chunks` on ``device``: bounded on the CPU, where
    the caller's peak memory is the host's; None (one chunk, the whole output) elsewhere."""
    return CPU_STREAM_ROWS if torch.device(device).type == "cpu" else None


def sparse_conv3d_chunks(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, neighbor_map: Optional[NeighborMap] = None, *,
                         subdivided: bool = False, coord_hash: Optional[CoordHash] = None, parent_map=None,
                         chunk_rows: Optional[int] = None) -> Iterator[tuple[slice, torch.Tensor]]:
    """:func:`sparse_conv3d`'s output in row chunks: yields ``(rows, out[rows])`` (``rows`` a slice, in order,
    covering all output rows), so a caller that consumes each chunk never holds the whole output.

    Arguments as :func:`sparse_conv3d`. ``chunk_rows``: output rows per chunk (default :func:`stream_rows` of the
    input's device; None there means one chunk). Only the child-block path of the portable backends computes
    chunk by chunk (chunks of whole parents, the same values as the whole output's rows); every other path
    computes the whole output and yields it as one chunk. Autocast applies as in :func:`sparse_conv3d`."""
    feats = feats.to(matmul_input_dtype(feats.dtype, feats.device))
    if chunk_rows is None:
        chunk_rows = stream_rows(feats.device)
    if (chunk_rows is not None and parent_map is not None and weight.dim() == 5 and weight.shape[1] == 3
            and feats.shape[0]):
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.has("lean"):
            check_conv_inputs(feats, coords[::8] if subdivided else coords, weight, bias)
            pmap = parent_map() if callable(parent_map) else parent_map
            _check_parent_map(pmap, coords)
            for first, end, out in blocked_sparse_conv3d_chunks(feats, pmap, weight, bias, subdivided=subdivided,
                                                                chunk_parents=max(1, chunk_rows // 8)):
                yield slice(8 * first, 8 * end), out
            return
    out = sparse_conv3d(feats, coords, weight, bias, neighbor_map, subdivided=subdivided, coord_hash=coord_hash,
                        parent_map=parent_map)
    yield slice(0, out.shape[0]), out
