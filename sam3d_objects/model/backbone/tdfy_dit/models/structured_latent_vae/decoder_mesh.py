"""Structured latent -> mesh: swin sparse transformer, two subdivision blocks (4x resolution), FlexiCubes."""
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

import backends

from ...modules import sparse as sp
from ...modules.sparse.spatial import subdivide_coords
from ...modules.utils import zero_module
from ...representations.mesh import MeshExtractResult, SparseFeatures2Mesh
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

    def forward(self, x: sp.SparseTensor) -> sp.SparseTensor:
        children = subdivide_coords(x)
        h = self.act_layers(x)  # at the parent level, as upstream (before subdividing)
        conv1, norm, act, conv2 = self.out_layers
        # Both convs share the coordinate data. The children are complete 2x2x2 blocks of the parents, so the
        # portable backends convolve on the parents with the parents' neighbour map (no [8N, C] copy of the
        # parents' features, no child-level hash or [8N, 27] table); other backends materialise the input and ask
        # for the children's neighbour map (built once, on first use).
        shared = dict(neighbor_map=lambda: children.neighbor_map(3))
        if self.blocked_convs:
            shared["parent_map"] = lambda: x.neighbor_map(3)  # the parents' map: 8x fewer rows than the children's
        else:
            shared["coord_hash"] = children.coord_hash()
        h = children.replace(backends.sparse_conv3d(h.feats, children.coords, conv1.conv.weight, conv1.conv.bias,
                                                    subdivided=True, **shared))
        h = norm(h)
        h = h.replace(F.silu(h.feats, inplace=True))  # the norm output is ours: activate in place
        h = h.replace(backends.sparse_conv3d(h.feats, h.coords, conv2.conv.weight, conv2.conv.bias, **shared))
        # a 1^3 conv is per voxel and children copy their parent: convolve the parents, add to their 8 children
        skip = x.feats if isinstance(self.skip_connection, nn.Identity) else self.skip_connection(x).feats
        out = h.feats.contiguous()
        out.view(skip.shape[0], 8, -1).add_(skip[:, None, :].to(out.dtype))
        return h.replace(out)


class SLatMeshDecoder(SparseTransformerBase):
    """Mesh decoder. ``device`` is where the mesh extractor keeps its small tables (no dense grids are built)."""

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
        for block in self.upsample:
            h = block(h)
        h = self.out_layer(h.type(x.dtype))
        return self.to_representation(h)


class SLatMeshDecoderTdfyWrapper(SLatMeshDecoder):
    """The class named by the released configs (same arguments and behaviour); `pretrained_ckpt_path` loads weights
    (a missing file is ignored, as upstream)."""

    def __init__(self, *args, pretrained_ckpt_path: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        load_pretrained(self, pretrained_ckpt_path, "SLatMeshDecoder", missing_ok=True)
