"""Dense sparse-structure flow DiT and the timestep embedder shared by every flow model."""
import math
import warnings
from collections import namedtuple
from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.nn as nn

import backends

from ..modules.attention.context_cache import condition_for_blocks
from ..modules.spatial import patchify, unpatchify
from ..modules.transformer import AbsolutePositionEmbedder, ModulatedTransformerCrossBlock
from ..modules.utils import Fp16Torso, init_flow_transformer_weights


# the dense grid and the optional pose token(s) of the old flow model
DataType = namedtuple("DataType", ["shape", "pose"])


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [N, dim] of (possibly fractional) timesteps t [N]: [cos | sin] of
    t * max_period^(-i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TimestepEmbedder(nn.Module):
    """Scalar timesteps -> vectors: sinusoidal features then Linear -> SiLU -> Linear (keys `mlp.0`, `mlp.2`)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        return timestep_embedding(t, dim, max_period)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            t = t.reshape(1)
        t_freq = timestep_embedding(t.reshape(-1), self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


def grid_positions(resolution: int, device=None) -> torch.Tensor:
    """[resolution^3, 3] integer grid positions in row-major (x slowest) order, as float32."""
    axis = torch.arange(resolution, device=device, dtype=torch.float32)
    grid = torch.meshgrid(axis, axis, axis, indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


class SparseStructureFlowModel(Fp16Torso, nn.Module):
    """Dense DiT on a [B, C, R, R, R] latent grid with cross-attention to condition tokens."""

    def __init__(self, resolution: int, in_channels: int, model_channels: int, cond_channels: int,
                 out_channels: int, num_blocks: int, num_heads: Optional[int] = None, num_head_channels: int = 64,
                 mlp_ratio: float = 4, patch_size: int = 2, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, share_mod: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, include_pose: bool = False, pose_weight: float = 1.0):
        super().__init__()
        warnings.warn("the dense SparseStructureFlowModel is upstream's old (deprecated) flow model; SAM 3D Objects "
                      "uses mot_sparse_structure_flow", DeprecationWarning, stacklevel=2)
        self.include_pose = include_pose
        self.pose_weight = pose_weight
        # the constructor's configuration, kept under upstream's attribute names
        self.resolution = resolution
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.model_channels = model_channels
        self.cond_channels = cond_channels
        self.num_blocks = num_blocks
        self.num_heads = num_heads or model_channels // num_head_channels
        self.mlp_ratio = mlp_ratio
        self.pe_mode = pe_mode
        self.share_mod = share_mod
        self.qk_rms_norm = qk_rms_norm
        self.qk_rms_norm_cross = qk_rms_norm_cross
        self.use_checkpoint = use_checkpoint
        self.use_fp16 = use_fp16

        self.t_embedder = TimestepEmbedder(model_channels)
        if share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(model_channels, 6 * model_channels, bias=True))
        if pe_mode == "ape":
            coords = grid_positions(resolution // patch_size)
            pos_emb = AbsolutePositionEmbedder(model_channels, 3)(coords)
            if include_pose:  # the pose token's embedding: 0.5 in every channel
                pos_emb = torch.cat([pos_emb, torch.full_like(pos_emb[:1], 0.5)], dim=0)
            self.register_buffer("pos_emb", pos_emb)
        self.input_layer = nn.Linear(in_channels * patch_size ** 3, model_channels)
        self.blocks = nn.ModuleList([
            ModulatedTransformerCrossBlock(model_channels, cond_channels, num_heads=self.num_heads,
                                           mlp_ratio=mlp_ratio, attn_mode="full", use_checkpoint=use_checkpoint,
                                           use_rope=(pe_mode == "rope"), share_mod=share_mod,
                                           qk_rms_norm=qk_rms_norm, qk_rms_norm_cross=qk_rms_norm_cross)
            for _ in range(num_blocks)])
        self.out_layer = nn.Linear(model_channels, out_channels * patch_size ** 3)
        if use_fp16:
            self.convert_to_fp16()

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.blocks,)

    def initialize_weights(self) -> None:
        """Training initialisation: xavier Linear weights / zero biases, N(0, 0.02) timestep MLP, zero adaLN
        output layers; the output layer is xavier (not zero), as upstream."""
        init_flow_transformer_weights(self)

    def forward(self, x: Union[torch.Tensor, DataType], t: torch.Tensor,
                cond: torch.Tensor) -> Union[torch.Tensor, DataType]:
        """x: the grid [B, C, R, R, R], or DataType(grid, pose) (pose [B, 1, C * p^3] when include_pose); returns
        the same kind."""
        if isinstance(x, DataType):
            grid, pose = self._forward(x.shape, t, cond, x.pose)
            return DataType(grid, pose)
        return self._forward(x, t, cond, None)[0]

    def _forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, pose: Optional[torch.Tensor]):
        r = self.resolution
        if tuple(x.shape[1:]) != (self.in_channels, r, r, r):
            raise ValueError(f"expected input [B, {self.in_channels}, {r}, {r}, {r}], got {tuple(x.shape)}")
        h = patchify(x, self.patch_size)
        h = h.reshape(h.shape[0], h.shape[1], -1).permute(0, 2, 1).contiguous()
        if self.include_pose:
            if pose is None:
                raise ValueError("include_pose=True needs the pose token: pass DataType(grid, pose)")
            h = torch.cat([h, pose.to(h.dtype)], dim=1)
        h = self.input_layer(h)
        if self.pe_mode == "ape":
            h = h + self.pos_emb[None]
        t_emb = self.t_embedder(t)
        if self.share_mod:
            t_emb = self.adaLN_modulation(t_emb)
        dtype = self.compute_dtype(h.device)
        t_emb = t_emb.type(dtype)
        h = h.type(dtype)
        # the blocks feed the condition tokens only to matmuls: cast them once to what those matmuls read (under
        # CPU autocast bf16, not float32 cast again by every block's key / value projection)
        cond = condition_for_blocks(self, cond, backends.device.matmul_input_dtype(dtype, cond.device))
        for block in self.blocks:
            h = block(h, t_emb, cond)
        h = h.type(x.dtype)
        h = backends.layer_norm(h, h.shape[-1:])
        h = self.out_layer(h)
        if self.include_pose:
            h, pose = h[:, :-1], h[:, -1:]
        side = r // self.patch_size
        h = h.permute(0, 2, 1).reshape(h.shape[0], h.shape[2], side, side, side)
        return unpatchify(h, self.patch_size).contiguous(), pose


class SparseStructureFlowTdfyWrapper(SparseStructureFlowModel):
    """The old flow model on tokens: forward(x [B, n^3 (+1 pose), C], t, *condition) -> tokens of the same layout.
    `condition_embedder` turns the condition arguments into tokens (identity by default); with `force_zeros_cond`
    a call with cfg=True zeroes them (the unconditional branch)."""

    def __init__(self, *args, condition_embedder: Optional[Callable] = None, force_zeros_cond: bool = False,
                 **kwargs):
        kwargs.pop("shape_attend_pose", None)  # accepted for old configs
        super().__init__(*args, **kwargs)
        self.condition_embedder = condition_embedder if condition_embedder is not None else (lambda c: c)
        self.force_zeros_cond = force_zeros_cond

    def forward(self, x: torch.Tensor, t: torch.Tensor, *condition_args: Any, **condition_kwargs: Any) -> torch.Tensor:
        cfg = condition_kwargs.pop("cfg", False)
        cond = self.condition_embedder(*condition_args, **condition_kwargs)
        if self.force_zeros_cond and cfg:
            cond = cond * 0
        pose = None
        if self.include_pose:
            x, pose = x[:, :-1], x[:, -1:]
        b, n, c = x.shape
        side = round(n ** (1 / 3))
        if side ** 3 != n:
            raise ValueError(f"{n} tokens do not form a cube")
        out = super().forward(DataType(x.permute(0, 2, 1).reshape(b, c, side, side, side), pose), t, cond)
        tokens = out.shape.reshape(b, out.shape.shape[1], n).permute(0, 2, 1)
        return torch.cat([tokens, out.pose], dim=1) if self.include_pose else tokens
