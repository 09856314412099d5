"""Point-map embedder: a point map [B, 3, H, W] -> one token per 8x8 window.

Each point is embedded linearly (non-finite points get the learned `invalid_xyz_token`), each window's points
plus a CLS token go through one ViT block, and the window CLS outputs plus a learned 2D position embedding are
the tokens.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .point_remapper import PointRemapper
from .vit import Block

REMAPS = tuple(PointRemapper.VALID_TYPES)
MPS_MAX_LINEAR_ROWS = 65536


def mps_linear_needs_chunks(shape: Tuple[int, ...], device_type: str, has_bias: bool = True) -> bool:
    """True where MPS F.linear returns wrong values (PyTorch issue 189495): an input of more than 2 dims, with a
    bias, whose size(-3) exceeds 65,536. 2-D inputs, no bias, or a smaller size(-3) are computed correctly."""
    return device_type == "mps" and has_bias and len(shape) > 2 and shape[-3] > MPS_MAX_LINEAR_ROWS


def remap_points(xyz: torch.Tensor, mode: str) -> torch.Tensor:
    """'linear': identity; 'exp': (x / (1 + z), y / (1 + z), log1p(z)) on [..., 3] points; see PointRemapper."""
    return PointRemapper(mode)(xyz)


class PointPatchEmbed(nn.Module):
    def __init__(self, input_size: int = 256, patch_size: int = 8, embed_dim: int = 768, num_heads: int = 16,
                 mlp_ratio: float = 2.0, remap_output: str = "exp", dropout_prob: float = 0.0,
                 force_dropout_always: bool = False):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input_size {input_size} must be a multiple of patch_size {patch_size}")
        if remap_output not in REMAPS:
            raise ValueError(f"unknown remap_output {remap_output!r} (use one of {REMAPS})")
        self.input_size = input_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        self.remap_output = remap_output
        self.dropout_prob = dropout_prob
        self.force_dropout_always = force_dropout_always
        self.point_remapper = PointRemapper(remap_output)
        grid = input_size // patch_size
        self.invalid_xyz_token = nn.Parameter(torch.zeros(embed_dim))
        if dropout_prob > 0:  # only then in upstream's checkpoints
            self.dropped_xyz_token = nn.Parameter(torch.zeros(embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_dim, grid, grid))
        self.pos_embed_window = nn.Parameter(torch.zeros(1, 1 + patch_size * patch_size, embed_dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.point_proj = nn.Linear(3, embed_dim)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=True)])

    def _resize(self, xyz: torch.Tensor) -> torch.Tensor:
        if not isinstance(xyz, torch.Tensor) or xyz.dim() != 4 or xyz.shape[1] != 3:
            raise ValueError(f"PointPatchEmbed expects a point map [B, 3, H, W], got "
                             f"{tuple(xyz.shape) if isinstance(xyz, torch.Tensor) else type(xyz).__name__}")
        if not xyz.dtype.is_floating_point:
            raise TypeError(f"the point map must be floating point, got {xyz.dtype}")
        return F.interpolate(xyz, size=(self.input_size, self.input_size), mode="nearest")

    def embed_pointmap_windows(self, xyz: torch.Tensor, valid_mask: Optional[torch.Tensor] = None
                               ) -> Tuple[torch.Tensor, int, int, int]:
        """Per-point embeddings on the resized grid and its size: ``(x [B, S, S, D], B, S, S)`` (upstream's 4
        values, the arguments of ``inner_forward``).

        Invalid points get the learned ``invalid_xyz_token``. Without ``valid_mask`` the invalid points are the
        non-finite ones; a given ``valid_mask`` [B, S, S] is used as is, as upstream does: a NaN point it marks
        valid is embedded as NaN (and its window's token becomes NaN)."""
        points = self.resize_input(xyz)
        if valid_mask is None:
            valid = torch.isfinite(points).all(dim=-1)
        else:
            expected = (points.shape[0], self.input_size, self.input_size)
            if tuple(valid_mask.shape) != expected:
                raise ValueError(f"valid_mask must be [B, {self.input_size}, {self.input_size}] (the resized grid), "
                                 f"got {tuple(valid_mask.shape)}")
            valid = valid_mask.to(device=points.device, dtype=torch.bool)
        batch, height, width = valid.shape
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"the embedding grid {height}x{width} must be divisible by patch_size {self.patch_size}")
        keep = valid.unsqueeze(-1)
        points = torch.where(keep, points, torch.zeros_like(points))
        emb = self.point_proj(self.point_remapper(points).to(self.point_proj.weight.dtype))
        emb = torch.where(keep, emb, torch.zeros_like(emb)) + (~keep).to(emb.dtype) * self.invalid_xyz_token
        return emb, batch, height, width

    def _run_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        """Window tokens [W, 1 + p*p, D] through the block(s); returns the CLS outputs [W, D]."""
        for block in self.blocks:
            tokens = block(tokens)
        return tokens[:, 0]

    @staticmethod
    def _windows_per_chunk(tokens: torch.Tensor) -> int:
        # tokens [W, 1 + p*p, D] reach the blocks' biased linears with size(-3) = W windows: only more than
        # 65,536 windows trigger the MPS bug (the full-size embedder has 1024), so chunk only then
        if mps_linear_needs_chunks(tuple(tokens.shape), tokens.device.type):
            return MPS_MAX_LINEAR_ROWS
        return tokens.shape[0]

    def initialize_weights(self) -> None:
        """Training initialisation: embeddings and tokens ~ N(0, 0.02), point_proj xavier (gain 0.02), zero bias."""
        for name in ("pos_embed", "pos_embed_window", "cls_token", "invalid_xyz_token", "dropped_xyz_token"):
            if hasattr(self, name):
                nn.init.normal_(getattr(self, name), std=0.02)
        nn.init.xavier_uniform_(self.point_proj.weight, gain=0.02)
        nn.init.zeros_(self.point_proj.bias)

    def resize_input(self, xyz: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> nearest-resized [B, S, S, 3] (S = input_size)."""
        return self._resize(xyz).permute(0, 2, 3, 1)

    def _get_pos_embed(self, hw: Tuple[int, int]) -> torch.Tensor:
        """The window position embedding resized (bilinear) to the (h, w) window grid: [1, h, w, D]."""
        return F.interpolate(self.pos_embed, size=tuple(hw), mode="bilinear", align_corners=False).permute(0, 2, 3, 1)

    def apply_pointmap_dropout(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Training-time (or forced) replacement of whole samples' tokens [B, n*n, C] by the dropped token."""
        forced = self.force_dropout_always
        if not (self.training or forced) or self.dropout_prob <= 0:
            return embeddings
        if not hasattr(self, "dropped_xyz_token"):
            if forced:
                raise RuntimeError("force_dropout_always needs dropout_prob > 0 (the dropped token)")
            return embeddings
        b, windows, c = embeddings.shape
        drop = (torch.ones(b, dtype=torch.bool, device=embeddings.device) if forced and not self.training
                else torch.rand(b, device=embeddings.device) < self.dropout_prob)
        n = math.isqrt(windows)
        dropped = self.dropped_xyz_token + self._get_pos_embed((n, n)).reshape(1, windows, c)
        return torch.where(drop[:, None, None], dropped.to(embeddings.dtype), embeddings)

    def inner_forward(self, x: torch.Tensor, B: int, H: int, W: int) -> torch.Tensor:  # noqa: N803
        """Per-point embeddings [B, H, W, C] -> window tokens [B, (H/p)*(W/p), C]."""
        p, d = self.patch_size, x.shape[-1]
        if H % p or W % p:
            raise ValueError(f"the embedding grid {H}x{W} must be divisible by patch_size {p}")
        nh, nw = H // p, W // p
        windows = x.reshape(B, nh, p, nw, p, d).permute(0, 1, 3, 2, 4, 5).reshape(B * nh * nw, p * p, d)
        tokens = torch.cat([self.cls_token.expand(windows.shape[0], -1, -1), windows], dim=1)
        tokens = tokens + self.pos_embed_window
        out = torch.cat([self._run_blocks(chunk) for chunk in tokens.split(self._windows_per_chunk(tokens))])
        out = (out.reshape(B, nh, nw, d) + self._get_pos_embed((nh, nw))).reshape(B, nh * nw, d)
        if (self.training or self.force_dropout_always) and self.dropout_prob > 0:
            out = self.apply_pointmap_dropout(out)
        return out

    def forward(self, xyz: torch.Tensor, valid_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x, B, H, W = self.embed_pointmap_windows(xyz, valid_mask)  # noqa: N806  upstream's names
        return self.inner_forward(x, B, H, W)
