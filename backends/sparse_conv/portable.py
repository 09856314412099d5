"""Submanifold sparse 3D convolution: the dispatch entry point and the portable implementations.

Rule (spconv's, pinned by the golden ``sparse_ops`` case): output rows are the input rows, and
``out[p] = bias + sum_k W[:, kx, ky, kz, :] @ in[p + (kx - r, ky - r, kz - r)]`` over neighbours present in the
same batch element, with ``W`` in spconv's ``[Cout, kx, ky, kz, Cin]`` layout and ``r = k // 2``.

Kernel size 1 is the exception: spconv runs it as a plain matmul that reads the ``[Cout, 1, 1, 1, Cin]`` buffer
as a ``[Cin, Cout]`` matrix (no transpose), and checkpoints were trained with that reading, so
``out = in @ W.reshape(Cin, Cout) + bias``. Every backend shares this through :func:`sparse_conv3d`.

Subdivided input (``subdivided=True``): ``feats`` hold one row per parent voxel and ``coords`` are the parents'
children (child row r copies parent row r // 8), as a subdivision leaves them. The memory-lean path of the
portable arithmetic never builds the [8N, Cin] copy nor an [8N, k^3] neighbour table (neighbours are looked up
one offset at a time in a ``CoordHash``); backends with their own kernels get the materialised input.

Child blocks (``parent_map=``): when ``coords`` are all 8 children of every parent (parent-major, upstream's child
order ``c = 4 cx + 2 cy + cz``), as right after a subdivision, a child's 3^3 neighbourhood lies in its parent's
3^3 parent neighbourhood and a child exists exactly when its parent does. The portable backends then run the
convolution on the parents (:func:`blocked_sparse_conv3d`): 27 parent offsets, each one GEMM of the parent
neighbour's rows (all 8 children side by side, ``[M, 8 Cin]``) against a block of the kernel, scattered into the
children it reaches. No child-level hash or neighbour table is built, the centre offset is one large GEMM with no
gather, and a subdivided input multiplies each parent once per parent offset (8 products per child, not 27).
The sums are the same up to float rounding (weights that meet the same parent are added before the product).
"""
from __future__ import annotations

from typing import Optional

import torch

from .hashing import CoordHash, NeighborMap, check_coords, kernel_offsets, neighbor_map as _neighbor_map
from .registry import Family, register, resolve

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


# Backends whose arithmetic the lean path reproduces, or (metal) whose device profits most from its bounded
# working set (unified memory): for them a lean request runs `lean_sparse_conv3d` on the input's device.
LEAN_BACKENDS = ("torch", "metal")


def sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, neighbor_map: Optional[NeighborMap] = None, *,
                  subdivided: bool = False, coord_hash: Optional[CoordHash] = None,
                  parent_map=None) -> torch.Tensor:
    """Submanifold convolution of ``feats`` [N, Cin] at ``coords`` [N, 4] (int32, b/x/y/z) -> [N, Cout].

    ``neighbor_map`` (from :func:`backends.neighbor_map`, or a zero-argument function returning one, called only
    when the chosen path needs a map) lets layers at the same coordinates share the map (``SparseTensor`` keeps
    it); without one a map is built for this call. The backend comes from ``SPARSE_BACKEND`` / ``backends.use``.

    ``subdivided=True``: ``feats`` [N, Cin] are parents of ``coords`` [8N, 4] (see the module docstring); the
    result has 8N rows. ``coord_hash`` (a ``CoordHash`` of ``coords``) asks for the memory-lean path and lets
    convolutions at the same coordinates share the hash; backends without a lean path ignore it.

    ``parent_map`` (the parents' kernel-3 :class:`NeighborMap`, or a zero-argument function returning it) states
    that ``coords`` are the complete child blocks of those parents (see the module docstring); the portable
    backends then convolve on the parents. Backends with their own kernels ignore it.
    """
    if parent_map is not None and weight.dim() == 5 and weight.shape[1] == 3 and feats.shape[0]:
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.name in LEAN_BACKENDS:
            check_conv_inputs(feats, coords[::8] if subdivided else coords, weight, bias)
            pmap = parent_map() if callable(parent_map) else parent_map
            if 8 * pmap.num_voxels != coords.shape[0] or pmap.kernel_size != 3:
                raise ValueError(f"parent_map must be the kernel-3 map of the {coords.shape[0] // 8} parents of "
                                 f"{coords.shape[0]} child coords, got {pmap.num_voxels} voxels, kernel "
                                 f"{pmap.kernel_size}")
            return blocked_sparse_conv3d(feats, pmap, weight, bias, subdivided=subdivided)
    if subdivided:
        if coords.shape[0] != 8 * feats.shape[0]:
            raise ValueError(f"subdivided=True needs 8 child coords per parent row: {feats.shape[0]} parents, "
                             f"{coords.shape[0]} coords")
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.name not in LEAN_BACKENDS:
            feats = _subdivide_rows(feats)
        else:
            check_conv_inputs(feats, coords[::8], weight, bias)  # one child per parent: the shapes line up
            return lean_sparse_conv3d(feats, coords, weight, bias, subdivided=True, coord_hash=coord_hash)
    elif coord_hash is not None and weight.shape[1] > 1:
        spec = resolve(Family.SPARSE_CONV, feats.device, feats.dtype)
        if spec.name in LEAN_BACKENDS:
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
    if neighbor_map is not None and (neighbor_map.num_voxels != feats.shape[0] or neighbor_map.kernel_size != k):
        raise ValueError(f"neighbor_map is for {neighbor_map.num_voxels} voxels and kernel {neighbor_map.kernel_size}, "
                         f"not {feats.shape[0]} voxels and kernel {k}")
    return spec.fn(feats, coords, weight, bias, neighbor_map)


def pointwise_conv(feats: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """1x1x1 submanifold conv with spconv's reading of the weight buffer (see the module docstring)."""
    out = feats @ weight.reshape(weight.shape[4], weight.shape[0])
    return out + bias if bias is not None else out


def _subdivide_rows(feats: torch.Tensor) -> torch.Tensor:
    """Per-parent rows -> 8 identical child rows (parent-major), as a subdivision lays them out."""
    return feats[:, None].expand(feats.shape[0], 8, *feats.shape[1:]).reshape(feats.shape[0] * 8, *feats.shape[1:])


def lean_sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], subdivided: bool = False,
                       coord_hash: Optional[CoordHash] = None, chunk_rows: int = 1 << 18) -> torch.Tensor:
    """The portable backend's arithmetic (centre offset first, then the other offsets in kernel order, each over
    its neighbour pairs in output-row order; bias last) with a bounded working set: neighbours are looked up one
    kernel offset at a time in a ``CoordHash`` (no [N, k^3] table) and gathered in chunks of ``chunk_rows``.
    With ``subdivided`` the centre GEMM runs on the parents (so it may round differently from the GEMM on the
    materialised children, BLAS blocking depends on the row count) and neighbours are gathered from the parents."""
    k = weight.shape[1]
    if weight.dtype != feats.dtype:
        weight = weight.to(feats.dtype)
    w = weight.permute(1, 2, 3, 4, 0).reshape(k ** 3, weight.shape[4], weight.shape[0])
    if feats.shape[0] == 0:
        return feats.new_zeros((coords.shape[0], weight.shape[0]))
    if k == 1:
        out = pointwise_conv(feats, weight, None if bias is None else bias.to(feats.dtype))
        return _subdivide_rows(out) if subdivided else out
    centre = k ** 3 // 2
    acc = _accumulate_dtype(feats.dtype, feats.device)
    out = (feats @ w[centre]).to(acc)
    if subdivided:
        out = _subdivide_rows(out)
    table = coord_hash if coord_hash is not None else CoordHash(coords)
    offsets = kernel_offsets(k, coords.device)
    for off in range(k ** 3):
        if off == centre:
            continue
        shift = torch.cat([offsets.new_zeros(1), offsets[off]]).to(coords.dtype)
        neighbour = table.lookup(coords + shift)
        out_rows = torch.nonzero(neighbour >= 0).flatten()
        for start in range(0, out_rows.numel(), chunk_rows):
            rows = out_rows[start:start + chunk_rows]
            src = neighbour[rows]
            if subdivided:
                src = torch.div(src, 8, rounding_mode="floor")
            out.index_add_(0, rows, (feats.index_select(0, src) @ w[off]).to(acc))
        del neighbour, out_rows
    if bias is not None:
        out += bias.to(acc)
    return out.to(feats.dtype)


def _axis_blocks(e: int, subdivided: bool) -> tuple[list[int], list[int], list[list[int]]]:
    """For one axis and parent offset ``e`` in {-1, 0, 1}: the children of the output parent it reaches, the
    children of the neighbour parent it reads (``[0]`` for a subdivided input: one row per parent), and for
    each (input, output) child pair the kernel taps (d + 1) that connect them (possibly none or two)."""
    outs = [c for c in (0, 1) if any((c + d) // 2 == e for d in (-1, 0, 1))]
    ins = [0] if subdivided else [c for c in (0, 1) if any(2 * e + c - o in (-1, 0, 1) for o in (0, 1))]
    taps = [[[d + 1 for d in (-1, 0, 1) if ((o + d) // 2 == e if subdivided else 2 * e + i - o == d)]
             for o in outs] for i in ins]
    return outs, ins, taps


def _block_weight(w: torch.Tensor, ex: tuple, subdivided: bool) -> tuple:
    """The kernel block of parent offset ``ex`` (3 ints), [n_in * Cin, n_out * Cout], with the child slots it
    writes and reads (``_child_ids``) and the per-axis slices of the written children. ``w`` is
    [3, 3, 3, Cin, Cout]."""
    axes = [_axis_blocks(e, subdivided) for e in ex]
    cin, cout = w.shape[3], w.shape[4]
    n_in = [len(a[1]) for a in axes]
    n_out = [len(a[0]) for a in axes]
    block = w.new_zeros(*n_in, cin, *n_out, cout)
    for ix in range(n_in[0]):
        for iy in range(n_in[1]):
            for iz in range(n_in[2]):
                for ox in range(n_out[0]):
                    for oy in range(n_out[1]):
                        for oz in range(n_out[2]):
                            for tx in axes[0][2][ix][ox]:
                                for ty in axes[1][2][iy][oy]:
                                    for tz in axes[2][2][iz][oz]:
                                        block[ix, iy, iz, :, ox, oy, oz] += w[tx, ty, tz]
    out_span = tuple(slice(a[0][0], a[0][-1] + 1) for a in axes)  # an axis' reached children are contiguous
    return (block.reshape(n_in[0] * n_in[1] * n_in[2] * cin, -1), _child_ids(*(a[0] for a in axes)),
            _child_ids(*(a[1] for a in axes)), out_span)


def _child_ids(xs: list[int], ys: list[int], zs: list[int]) -> torch.Tensor:
    """Child slots ``4 cx + 2 cy + cz`` of the given per-axis children, in row-major order."""
    return torch.tensor([4 * x + 2 * y + z for x in xs for y in ys for z in zs], dtype=torch.int64)


class _ChunkScratch:
    """The gather and product buffers of one blocked convolution, reused by all its chunks and offsets.

    A fresh tensor per chunk costs more than the gather itself on CPU: glibc serves allocations over 32 MB with
    their own mapping and unmaps them on free, so every chunk's pages are faulted in anew (on the 2-core machine
    the full-size mesh decoder spent a fifth of its time in the kernel). Buffers grow to the largest chunk seen."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def _take(self, name: str, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        buf = self._flat.get(name)
        if buf is None or buf.numel() < rows * cols:
            self._flat.pop(name, None)  # free the smaller buffer before allocating its successor
            buf = self._flat[name] = like.new_empty(rows * cols)
        return buf[:rows * cols].view(rows, cols)

    def gather(self, feats: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        """``feats[index]`` as ``rows`` rows (each holding ``len(index) // rows`` consecutive picks)."""
        picked = self._take("gather", feats, index.numel(), feats.shape[1])
        torch.index_select(feats, 0, index, out=picked)
        return picked.view(rows, -1)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b, out=self._take("product", a, a.shape[0], b.shape[1]))


def blocked_sparse_conv3d(feats: torch.Tensor, parent_map: NeighborMap, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], subdivided: bool = False,
                          chunk_bytes: int = 1 << 26, dense_share: float = 0.5) -> torch.Tensor:
    """Kernel-3 submanifold conv on complete child blocks, computed on the parents (module docstring).

    ``feats``: [8P, Cin] child rows (parent-major), or [P, Cin] parent rows with ``subdivided`` (each child copies
    its parent). ``parent_map``: kernel-3 neighbour map of the P parents. Returns [8P, Cout]. Gathers and their
    products run in chunks of about ``chunk_bytes`` of gathered input (bounded working set).

    An offset whose neighbour exists for at least ``dense_share`` of the parents runs over all parents (missing
    neighbours read as zero rows) and adds into the output's child slice in place: the extra products cost less
    than a scatter (``index_add_`` runs at a fraction of memory speed on CPU). Shells of voxels have 66-80% of
    their 27 parent neighbours. Sparser offsets multiply their neighbour pairs only and scatter them."""
    if weight.dtype != feats.dtype:
        weight = weight.to(feats.dtype)
    cin, cout = weight.shape[4], weight.shape[0]
    parents = parent_map.num_voxels
    acc = _accumulate_dtype(feats.dtype, feats.device)
    # taps meeting the same parent are summed once per call (a few MB), in the accumulation dtype
    w = weight.permute(1, 2, 3, 4, 0).to(acc)
    per_parent = 1 if subdivided else 8
    scratch = _ChunkScratch()
    out = None
    offsets = kernel_offsets(3)
    centre = 13
    for off in [centre] + [o for o in range(27) if o != centre]:
        ex = tuple(int(v) for v in offsets[off])
        block, out_ids, in_ids, out_span = _block_weight(w, ex, subdivided)
        block = block.to(feats.dtype)
        if off == centre:
            # every parent is its own neighbour: one GEMM over all rows, no gather, written straight to the output
            out = (feats.reshape(parents, -1) @ block).to(acc).reshape(parents * 8, cout)
            continue
        in_ids, out_ids = in_ids.to(feats.device), out_ids.to(feats.device)
        chunk = max(1, chunk_bytes // max(1, block.shape[0] * feats.element_size()))
        column = parent_map.table[:, off]
        if int((column >= 0).sum()) >= dense_share * parents:
            slots = out.view(parents, 2, 2, 2, cout)
            for start in range(0, parents, chunk):
                col = column[start:start + chunk].long()
                missing = torch.nonzero(col < 0).flatten()
                col = col.clamp(min=0)
                src = col[:, None] * per_parent + in_ids if not subdivided else col
                gathered = scratch.gather(feats, src.reshape(-1), col.numel())
                gathered.index_fill_(0, missing, 0)  # only the missing rows are written, not a pass over all
                prod = scratch.product(gathered, block)
                part = slots[start:start + col.numel()][(slice(None),) + out_span]
                part += prod.view(part.shape)  # promotes a half product into the float32 sum
            continue
        in_rows, out_rows = parent_map.pairs(off)
        if not in_rows.numel():
            continue
        for start in range(0, in_rows.numel(), chunk):
            rows_in, rows_out = in_rows[start:start + chunk], out_rows[start:start + chunk]
            # Gathers and scatters address single child rows of the contiguous [rows, C] tensors: index_select /
            # index_add_ on a strided child slice are several times slower on CPU.
            src = rows_in[:, None] * per_parent + in_ids if not subdivided else rows_in
            gathered = scratch.gather(feats, src.reshape(-1), rows_in.numel())
            prod = scratch.product(gathered, block).to(acc).reshape(-1, cout)
            out.index_add_(0, (rows_out[:, None] * 8 + out_ids).reshape(-1), prod)
    if bias is not None:
        out += bias.to(acc)
    return out.to(feats.dtype)


def _map_for(coords, k, nmap):
    return nmap if nmap is not None else _neighbor_map(coords, k)


def _accumulate_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # Summing 27 partial products in half precision loses bits that spconv keeps (it accumulates in fp32).
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register(Family.SPARSE_CONV, "torch", devices=("cpu", "cuda", "mps"), dtypes=FLOAT_DTYPES + (torch.float64,),
          priority=0)
def torch_sparse_conv3d(feats, coords, weight, bias=None, nmap=None):
    """Gather-GEMM-scatter over the neighbour pairs of each kernel offset; only existing pairs are multiplied
    (a surface has ~9 of 27 neighbours), and the centre offset is one dense GEMM."""
    k = weight.shape[1]
    cout = weight.shape[0]
    w = weight.permute(1, 2, 3, 4, 0).reshape(k ** 3, feats.shape[1], cout)  # [K, Cin, Cout]
    acc = _accumulate_dtype(feats.dtype, feats.device)
    centre = (k ** 3) // 2
    out = (feats @ w[centre]).to(acc)
    nmap = _map_for(coords, k, nmap)
    for off in range(k ** 3):
        if off == centre:
            continue
        in_rows, out_rows = nmap.pairs(off)
        if in_rows.numel():
            out.index_add_(0, out_rows, (feats.index_select(0, in_rows) @ w[off]).to(acc))
    if bias is not None:
        out += bias
    return out.to(feats.dtype)


def _spconv_probe(device: torch.device) -> Optional[str]:
    if device.type == "cpu":
        # spconv's CPU kernels race with more than one OpenMP thread (PLATFORMS.md): wrong rows, silently.
        if torch.get_num_threads() != 1:
            return (f"spconv on CPU is only correct with one thread (torch has {torch.get_num_threads()}); "
                    "call torch.set_num_threads(1) and set OMP_NUM_THREADS=1, or use 'torch'")
    return None


@register(Family.SPARSE_CONV, "spconv", devices=("cpu", "cuda"), dtypes=(torch.float32, torch.float16),
          requires=("spconv",), probe=_spconv_probe, priority=20, auto_devices=("cuda",),
          volatile=True)
def spconv_sparse_conv3d(feats, coords, weight, bias=None, nmap=None):
    """The installed spconv package, same weight layout. spconv's own index pairs are built on the first call for
    a coordinate set and kept with our neighbour map, so layers at the same coordinates reuse them."""
    import spconv.pytorch as spconv

    k = weight.shape[1]
    template = _map_for(coords, k, nmap).extra(("spconv", k), lambda _: _spconv_template(feats, coords, k))
    key = (weight.shape[4], weight.shape[0], k, weight.device, weight.dtype)
    if key not in _SPCONV_MODULES:
        # Building (and randomly initialising) a module per call costs milliseconds; one per shape is kept and
        # pointed at the caller's weight each time.
        conv = spconv.SubMConv3d(key[0], key[1], k, bias=False, indice_key=_SPCONV_KEY).to(key[3], key[4])
        _SPCONV_MODULES[key] = conv.requires_grad_(False)
    conv = _SPCONV_MODULES[key]
    conv.weight.data = weight.detach()  # an inference adapter: no gradients flow through it
    out = conv(template.replace_feature(feats.contiguous())).features
    return out + bias if bias is not None else out


_SPCONV_KEY = "sam3d_subm"
_SPCONV_MODULES: dict = {}


def _spconv_template(feats, coords, k):
    """A SparseConvTensor whose index dictionary is shared by every ``replace_feature`` copy."""
    import spconv.pytorch as spconv

    c = coords.to(torch.int32).contiguous()
    shape = (c[:, 1:].max(dim=0).values + k).tolist()
    return spconv.SparseConvTensor(feats.contiguous(), c, shape, int(c[:, 0].max()) + 1)


_TORCHSPARSE_ORDER: dict = {}


def _torchsparse_run(feats, coords, weight, order):
    import torchsparse
    import torchsparse.nn.functional as TF

    k = weight.shape[1]
    perm = (1, 2, 3) if order == "xyz" else (3, 2, 1)
    w = weight.permute(*perm, 4, 0).reshape(k ** 3, weight.shape[4], weight.shape[0]).contiguous()
    x = torchsparse.SparseTensor(feats.contiguous(), coords.to(torch.int32).contiguous())
    return TF.conv3d(x, w, kernel_size=(k, k, k), bias=None, stride=1).feats


def _torchsparse_offset_order(device, dtype) -> str:
    """torchsparse's kernel-offset order has changed between releases; find it once by comparing a tiny random
    convolution with the portable implementation, and refuse to run if neither order matches."""
    if "order" not in _TORCHSPARSE_ORDER:
        g = torch.Generator(device="cpu").manual_seed(0)
        coords = torch.unique(torch.randint(0, 5, (60, 3), generator=g), dim=0)
        coords = torch.cat([torch.zeros_like(coords[:, :1]), coords], 1).to(device=device, dtype=torch.int32)
        feats = torch.randn(coords.shape[0], 4, generator=g).to(device, dtype)
        weight = torch.randn(3, 3, 3, 3, 4, generator=g).to(device, dtype)
        want = torch_sparse_conv3d(feats, coords, weight)
        for order in ("xyz", "zyx"):
            if torch.allclose(_torchsparse_run(feats, coords, weight, order), want, atol=1e-2, rtol=1e-2):
                _TORCHSPARSE_ORDER["order"] = order
                break
        else:
            raise RuntimeError("the installed torchsparse gives results that match neither kernel-offset order; "
                               "use SPARSE_BACKEND=torch")
    return _TORCHSPARSE_ORDER["order"]


@register(Family.SPARSE_CONV, "torchsparse", devices=("cuda",), dtypes=(torch.float32, torch.float16),
          requires=("torchsparse",), priority=10)
def torchsparse_sparse_conv3d(feats, coords, weight, bias=None, nmap=None):
    """torchsparse (2.1+, coords as b/x/y/z) adapter; its offset order is checked once against ours."""
    out = _torchsparse_run(feats, coords, weight, _torchsparse_offset_order(feats.device, feats.dtype))
    return out + bias if bias is not None else out
