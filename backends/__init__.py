"""Device-agnostic ops for SAM 3D Objects, chosen per device through one registry.

Public API::

    backends.sparse_conv3d(feats, coords, weight, bias=None, neighbor_map=None)   # submanifold conv
    backends.sparse_conv3d_chunks(feats, coords, weight, ...)                       # its output in row chunks
    backends.sparse_conv3d_upsampled(parent_feats, parent_index, coords, weight)   # conv of an upsampling
    backends.stream_rows(device)                                                    # their default size (None: whole)
    backends.neighbor_map(coords, kernel_size)                                      # neighbour map (keep it: SparseTensor does)
    backends.CoordHash(coords).lookup(query)                                        # sort-based voxel hash
    backends.dense_conv3d(x, weight, bias, padding)                                 # stride-1 Conv3d, MPS-safe
    backends.sort(x) / backends.argsort(x) / backends.unique(x, ...)               # MPS-safe sorting
    backends.unique_codes(codes, size, ...) / backends.unique_pairs(a, b, size, cls, n)   # uniques without a sort
    backends.index_add_ranked_(out, index, src, ranks, n) / backends.slot_ranks(idx)   # row-ordered sums, parallel
    backends.SlotScatter(index, n).add_(out, start, values)                        # the same, values in row chunks
    backends.attention(q, k, v, scale=None)                                         # [B, L, H, D]
    backends.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)             # flash_attn's layout
    backends.group_norm(x, groups, w, b) / backends.layer_norm(x, width, w, b)      # native by default
    backends.float32_layer_norm(x, width, w, b)      # LayerNorm32: half x normalised in float32, rounded once
    backends.group_norm_rows_(rows, groups, w, b)                                   # voxel rows, in place on CPU
    backends.modulated_layer_norm(x, shift, scale) / backends.gated_residual(x, h, gate)   # adaLN steps
    backends.head_rms_norm(q, gamma, scale)                                         # per-head q/k RMS norm
    backends.linear_gelu(x, weight, bias)                                           # MLP: tanh-GELU(linear)
    backends.quantized_linear(x, weight, scale, bias) / backends.quantize_int8(w)   # int8 / bf16 weights
    backends.prepack_bf16_weight(w)                  # CPU bf16 weight packed once for quantized_linear(packed=)
    with backends.use(sparse="torch", attn="sdpa", norm="native"): ...             # scoped override
    backends.set_backend(sparse=..., sparse_attn=..., attn=..., norm=...)          # process-wide override
    backends.current(device)                                                        # what runs where
    backends.device                                                                 # device/autocast/memory helpers

Environment: read only by ``backends.env_value`` / ``backends.env_flag``; every variable is listed in
``backends.registry.ENVIRONMENT`` (the op settings: ``SPARSE_BACKEND``, ``SPARSE_ATTN_BACKEND`` falling back to
``ATTN_BACKEND``, ``NORM_BACKEND``, ...) or ``backends.registry.SETTINGS`` (the others: ``SAM3D_CHECKPOINTS``, ...);
``python -m backends`` prints every backend per device and what ``auto`` picks.

Layering: ``registry`` imports nothing of ``backends``; every other module imports it. Kernels are filed by op
family: ``sparse_conv/``, ``attn/`` and ``norm/`` are packages whose ``__init__`` is the dispatcher and whose
modules are the backends (``portable``, ``triton``, ``metal``, ``cuda``, ``spconv``...), each registering itself with
its constraints and capabilities when its package is imported (the import order below is the registration order);
``metal/`` holds the Metal runtime and MSL sources the Metal backends share; ``splat/``, ``rasterize`` and
``soft_rasterize`` are the rendering arithmetic.
"""
from . import device, filters
from .dense_conv import dense_conv3d
from .attn import (attention, attention_through_context, context_shortcut_pays, max_attention_bytes,
                   set_max_attention_bytes, varlen_attention)
from .hashing import CoordHash, NeighborMap, clear_cache, kernel_offsets, neighbor_map
from .norm import (float32_layer_norm, gated_residual, group_norm, group_norm_rows_, head_rms_norm, layer_norm,
                   linear_gelu, modulated_layer_norm)
from .quant_linear import prepack_bf16_weight, quantize_int8, quantized_linear
from .registry import (AttentionBackend, BackendUnavailableError, Family, NormBackend, QuantLinearBackend,
                       SparseConvBackend, register, registered, reset_backends, resolve, set_backend, use)
from .inventory import current, report
from .registry import env_flag, env_value, requested as _requested


def requested_backend(family: str) -> str:
    """The backend name requested for a family ("sparse_conv", "sparse_attn", "attn", "norm") by ``use()``,
    ``set_backend()`` or the environment, before device-based resolution ("auto" when nothing was asked)."""
    return _requested(Family(family))[0]
from .sorting import argsort, sort, unique
from .scatter import SlotScatter, index_add_ranked_, slot_ranks, unique_codes, unique_pairs
from .sparse_conv import sparse_conv3d, sparse_conv3d_chunks, sparse_conv3d_upsampled, stream_rows

__all__ = [
    "attention", "attention_through_context", "context_shortcut_pays", "varlen_attention", "max_attention_bytes", "set_max_attention_bytes",
    "sparse_conv3d", "sparse_conv3d_chunks", "sparse_conv3d_upsampled", "stream_rows", "dense_conv3d", "group_norm", "group_norm_rows_", "layer_norm", "float32_layer_norm", "modulated_layer_norm", "gated_residual",
    "head_rms_norm", "linear_gelu", "quantized_linear", "quantize_int8", "prepack_bf16_weight", "neighbor_map", "NeighborMap", "CoordHash",
    "kernel_offsets", "clear_cache",
    "sort", "argsort", "unique", "unique_codes", "unique_pairs", "index_add_ranked_", "slot_ranks", "SlotScatter",
    "use", "set_backend", "reset_backends", "current", "report", "resolve", "register", "registered",
    "requested_backend", "env_value", "env_flag",
    "Family", "SparseConvBackend", "NormBackend", "AttentionBackend", "QuantLinearBackend", "BackendUnavailableError",
    "device",
]
from . import rasterize  # noqa: E402  (triangle rasteriser: backends.rasterize.rasterize/interpolate/texture)
from . import soft_rasterize  # noqa: E402  (soft fragments + sigmoid coverage: PyTorch3D-style silhouettes)
from . import curves  # noqa: E402  (z-order / Hilbert codes of voxel coordinates)
