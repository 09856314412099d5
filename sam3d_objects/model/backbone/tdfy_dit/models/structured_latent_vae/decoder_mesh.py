"""Structured latent -> mesh: swin sparse transformer, two subdivision blocks (4x resolution), FlexiCubes."""
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

import backends

from ...modules import sparse as sp
from ...modules.sparse.spatial import subdivide_coords
from ...modules.utils import zero_module
from ...representations.mesh import MeshExtractResult, SparseFeatures2Mesh
from ...representations.mesh.cube2mesh import CubeFeatureStream
from ..structured_latent_flow import check_sparse_input
from ..sparse_structure_vae import load_pretrained
from .base import SparseTransformerBase

__all__ = ["SparseSubdivideBlock3d", "SLatMeshDecoder", "SLatMeshDecoderTdfyWrapper"]


class SparseSubdivideBlock3d(nn.Module):
    """GroupNorm+SiLU, subdivide (2x), conv3 -> GroupNorm -> SiLU -> conv3, plus a (1^3 conv) skip of the
    subdivided input."""

    # The children of a subdivision are complete 2x2x2 blocks of the parents: the portable backends convolve on
    # the parents (no child-level hash or table). False keeps the child-level lean path (benchmark comparisons).
    blocked_convs = True

    def __init__(self, channels: int, resolution: int, out_channels: Optional[int] = None, num_groups: int = 32):
        super().__init__()
        self.channels = channels
        self.resolution = resolution
        self.out_resolution = resolution * 2
        self.out_channels = out_channels or channels
        key = f"res_{self.out_resolution}"
        self.act_layers = nn.Sequential(sp.SparseGroupNorm32(num_groups, channels), sp.SparseSiLU())
        self.sub = sp.SparseSubdivide()
        self.out_layers = nn.Sequential(
            sp.SparseConv3d(channels, self.out_channels, 3, indice_key=key),
            sp.SparseGroupNorm32(num_groups, self.out_channels),
            sp.SparseSiLU(),
            zero_module(sp.SparseConv3d(self.out_channels, self.out_channels, 3, indice_key=key)),
        )
        self.skip_connection = (nn.Identity() if self.out_channels == channels
                                else sp.SparseConv3d(channels, self.out_channels, 1, indice_key=key))

    def _coordinate_maps(self, x: sp.SparseTensor, children: sp.SparseTensor) -> dict:
        """What both convs share of the coordinate data. The children are complete 2x2x2 blocks of the parents,
        so the portable backends convolve on the parents with the parents' neighbour map (no [8N, C] copy of the
        parents' features, no child-level hash or [8N, 27] table); other backends materialise the input and ask
        for the children's neighbour map (built once, on first use)."""
        shared = dict(neighbor_map=lambda: children.neighbor_map(3))
        if self.blocked_convs:
            parents = x.replace(x.feats.new_empty(x.feats.shape[0], 0))  # x's coordinates and map, not its features
            shared["parent_map"] = lambda: parents.neighbor_map(3)  # the parents' map: 8x fewer rows
        else:
            shared["coord_hash"] = children.coord_hash()
        return shared

    def _first_half(self, h: sp.SparseTensor, children: sp.SparseTensor, shared: dict) -> sp.SparseTensor:
        """(``h`` = act(x)) -> subdivide -> conv1 -> norm -> SiLU: conv2's input on the children."""
        conv1, norm, _, _ = self.out_layers
        h = children.replace(backends.sparse_conv3d(h.feats, children.coords, conv1.conv.weight, conv1.conv.bias,
                                                    subdivided=True, **shared))
        # the conv output is ours: normalise it in place where the norm backend can (not under autograd, whose
        # backward reads it), then activate in place
        h = norm(h) if torch.is_grad_enabled() else norm.normalize_(h)
        return h.replace(F.silu(h.feats, inplace=True))

    def _skip(self, x: sp.SparseTensor) -> torch.Tensor:
        """The skip branch on the parents: a 1^3 conv is per voxel and children copy their parent."""
        return x.feats if isinstance(self.skip_connection, nn.Identity) else self.skip_connection(x).feats

    def forward(self, x: sp.SparseTensor) -> sp.SparseTensor:
        children = subdivide_coords(x)
        shared = self._coordinate_maps(x, children)
        h = self._first_half(self.act_layers(x), children, shared)  # act at the parent level, as upstream
        conv2 = self.out_layers[3]
        h = h.replace(backends.sparse_conv3d(h.feats, h.coords, conv2.conv.weight, conv2.conv.bias, **shared))
        skip = self._skip(x)  # convolve the parents, add to their 8 children
        out = h.feats.contiguous()
        out.view(skip.shape[0], 8, -1).add_(skip[:, None, :].to(out.dtype))
        return h.replace(out)

    def stream(self, x: sp.SparseTensor, children: Optional[sp.SparseTensor] = None,
               chunk_rows: Optional[int] = None) -> Iterator[Tuple[slice, torch.Tensor]]:
        """The forward's output rows in chunks, for inference: yields ``(rows, feats[rows])`` in order (``rows``
        a slice of ``children``'s rows, ``children`` = ``subdivide_coords(x)``). The second conv runs chunk by
        chunk where the sparse-conv backend streams (``backends.sparse_conv3d_chunks``: on the CPU; elsewhere one
        chunk), so the block's [8N, C] output is never whole. ``x`` is released once read: a caller that drops
        its own reference after creating the generator frees the input before the convolutions run."""
        children = subdivide_coords(x) if children is None else children
        shared = self._coordinate_maps(x, children)
        skip = self._skip(x)
        h = self.act_layers(x)
        del x  # the skip and the activation are all that is needed of the input
        h = self._first_half(h, children, shared)
        conv2 = self.out_layers[3]
        for rows, out in backends.sparse_conv3d_chunks(h.feats, h.coords, conv2.conv.weight, conv2.conv.bias,
                                                       chunk_rows=chunk_rows, **shared):
            first, end = rows.start // 8, rows.stop // 8
            out = out.contiguous()
            out.view(end - first, 8, -1).add_(skip[first:end, None, :].to(out.dtype))
            yield rows, out


class SLatMeshDecoder(SparseTransformerBase):
    """Mesh decoder. ``device`` is where the mesh extractor keeps its small tables (no dense grids are built).

    At inference (no autograd) the last subdivision block, the output layer and the mesh extraction run as one
    stream of row chunks (:meth:`SparseSubdivideBlock3d.stream`, ``CubeFeatureStream``): the block's [64N, C]
    output and the output layer's [64N, 101] features are never whole on the CPU, where they held the
    decoder's peak memory. The mesh is the same as the whole-tensor path's (``stream_tail = False``; faces
    identical, vertices bit-identical where the BLAS rounds a GEMM row independently of the row count, else within
    float rounding); forward hooks on ``out_layer`` then see one call per chunk, and the last block's own forward
    is not called. ``stream_rows``: output rows per chunk (None: ``backends.stream_rows`` of the device; where
    that is None, off the CPU, the whole path runs as before); outputs of at most one chunk take the whole path.
    """

    stream_tail = True
    stream_rows: Optional[int] = None

    def initialize_weights(self) -> None:
        """Training initialisation (not run at construction: checkpoints overwrite it): xavier Linear weights,
        zero biases, zero output layer."""
        self._initialize_with_zero_output()

    def __init__(self, resolution: int, model_channels: int, latent_channels: int, num_blocks: int,
                 num_heads: Optional[int] = None, num_head_channels: int = 64, mlp_ratio: float = 4,
                 attn_mode: str = "swin", window_size: int = 8, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, qk_rms_norm: bool = False,
                 representation_config: Optional[Dict] = None, device: Union[str, torch.device] = "cpu"):
        super().__init__(in_channels=latent_channels, model_channels=model_channels, num_blocks=num_blocks,
                         num_heads=num_heads, num_head_channels=num_head_channels, mlp_ratio=mlp_ratio,
                         attn_mode=attn_mode, window_size=window_size, pe_mode=pe_mode, use_fp16=use_fp16,
                         use_checkpoint=use_checkpoint, qk_rms_norm=qk_rms_norm)
        self.resolution = resolution
        self.rep_config = dict(representation_config or {})
        self.mesh_extractor = SparseFeatures2Mesh(device=device, res=resolution * 4,
                                                  use_color=self.rep_config.get("use_color", False))
        self.out_channels = self.mesh_extractor.feats_channels
        self.upsample = nn.ModuleList([
            SparseSubdivideBlock3d(channels=model_channels, resolution=resolution, out_channels=model_channels // 4),
            SparseSubdivideBlock3d(channels=model_channels // 4, resolution=resolution * 2,
                                   out_channels=model_channels // 8),
        ])
        self.out_layer = sp.SparseLinear(model_channels // 8, self.out_channels)
        if use_fp16:
            self.convert_to_fp16()

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.blocks, self.upsample)

    def to_representation(self, x: sp.SparseTensor) -> List[MeshExtractResult]:
        return [self.mesh_extractor(x[i], training=self.training) for i in range(x.shape[0])]

    def forward(self, x: sp.SparseTensor) -> List[MeshExtractResult]:
        """One MeshExtractResult per batch element. Empty input (0 voxels) -> an empty list; a batch element
        whose surface is empty gets a result with 0 vertices / 0 faces (``success`` False)."""
        if x.coords.shape[0] == 0:
            return []
        check_sparse_input(x, self.in_channels, self.resolution, type(self).__name__)
        h = super().forward(x)
        for block in self.upsample[:-1]:
            h = block(h)
        rows = self.stream_rows or backends.stream_rows(h.device)
        # outputs of up to one chunk take the whole path (the modules' own calls: hooks see them as always)
        if self.stream_tail and rows and 8 * h.coords.shape[0] > rows and not torch.is_grad_enabled():
            children = subdivide_coords(h)
            # the vertex grids first, while the least is alive
            streams = [self.mesh_extractor.stream(children.coords[rows, 1:]) for rows in children.layout]
            chunks = self.upsample[-1].stream(h, children, chunk_rows=rows)
            del h  # the generator holds the block's input until it has read it
            return self._stream_meshes(chunks, children, streams, x.dtype)
        h = self.upsample[-1](h)
        h = self.out_layer(h.type(x.dtype))
        return self.to_representation(h)

    def _stream_meshes(self, chunks: Iterator[Tuple[slice, torch.Tensor]], children: sp.SparseTensor,
                       streams: List[CubeFeatureStream], dtype: torch.dtype) -> List[MeshExtractResult]:
        """Output layer and mesh extraction chunk by chunk: each chunk's rows go to the streams of the batch
        elements they belong to."""
        for rows, feats in chunks:
            n = rows.stop - rows.start
            chunk = sp.SparseTensor(feats=feats.type(dtype), coords=children.coords[rows], shape=(1, feats.shape[1]),
                                    layout=[slice(0, n)])
            del feats
            out = self.out_layer(chunk).feats
            del chunk
            for stream, part in zip(streams, children.layout):
                lo, hi = max(part.start, rows.start), min(part.stop, rows.stop)
                if hi > lo:
                    stream.add(out[lo - rows.start:hi - rows.start])
            del out
        return [stream.finish(training=self.training) for stream in streams]


class SLatMeshDecoderTdfyWrapper(SLatMeshDecoder):
    """The class named by the released configs (same arguments and behaviour); `pretrained_ckpt_path` loads weights
    (a missing file is ignored, as upstream)."""

    def __init__(self, *args, pretrained_ckpt_path: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        load_pretrained(self, pretrained_ckpt_path, "SLatMeshDecoder", missing_ok=True)
