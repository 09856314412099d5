"""DINOv2 vision transformer with torch.hub's module and parameter names, built locally (no hub, no network).

`build_dinov2(name, **overrides)` takes a hub model name (`dinov2_vit{s,b,l,g}14[_reg]`) and optional size
overrides (`img_size`, `embed_dim`, `depth`, `num_heads`, ...), mirroring `torch.hub.load(..., name, **kwargs)`.
"""
import math
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from .vit import Block

ARCHITECTURES = {
    "vits14": dict(embed_dim=384, depth=12, num_heads=6, ffn_layer="mlp"),
    "vitb14": dict(embed_dim=768, depth=12, num_heads=12, ffn_layer="mlp"),
    "vitl14": dict(embed_dim=1024, depth=24, num_heads=16, ffn_layer="mlp"),
    "vitg14": dict(embed_dim=1536, depth=40, num_heads=24, ffn_layer="swiglufused"),
}


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens [B, N, D] (`proj` is a strided Conv2d)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {self.patch_size}")
        return self.proj(x).flatten(2).transpose(1, 2)


class DinoVisionTransformer(nn.Module):
    """ViT with CLS token, optional register tokens and learned (interpolated) position embeddings."""

    def __init__(self, img_size: int = 518, patch_size: int = 14, in_chans: int = 3, embed_dim: int = 1024,
                 depth: int = 24, num_heads: int = 16, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 ffn_bias: bool = True, proj_bias: bool = True, init_values: float = 1.0, ffn_layer: str = "mlp",
                 num_register_tokens: int = 0, interpolate_antialias: bool = False,
                 interpolate_offset: float = 0.1, drop_path_rate: float = 0.0, drop_path_uniform: bool = False,
                 block_chunks: int = 0):
        # drop_path_* (training only) and block_chunks (FSDP grouping, same keys here as unchunked checkpoints
        # use) are accepted for hub compatibility and change nothing at inference
        super().__init__()
        self.embed_dim = self.num_features = embed_dim
        self.patch_size = patch_size
        self.num_register_tokens = num_register_tokens
        self.interpolate_antialias = interpolate_antialias
        self.interpolate_offset = interpolate_offset
        self.img_size = img_size
        num_patches = (img_size // patch_size) ** 2

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.register_tokens = (nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim))
                                if num_register_tokens else None)
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_bias=proj_bias,
                  ffn_bias=ffn_bias, init_values=init_values, ffn_layer=ffn_layer) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Identity()

    def interpolate_pos_encoding(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Position embeddings for an h x w image (bicubic resize of the patch grid when it differs)."""
        n_patches = x.shape[1] - 1
        n_stored = self.pos_embed.shape[1] - 1
        if n_patches == n_stored and h == w:
            return self.pos_embed
        pos = self.pos_embed.float()
        cls_pos, patch_pos = pos[:, :1], pos[:, 1:]
        side = int(math.sqrt(n_stored))
        h0, w0 = h // self.patch_size, w // self.patch_size
        grid = patch_pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        if self.interpolate_offset:
            scale = ((h0 + self.interpolate_offset) / side, (w0 + self.interpolate_offset) / side)
            grid = F.interpolate(grid, scale_factor=scale, mode="bicubic", antialias=self.interpolate_antialias)
        else:
            grid = F.interpolate(grid, size=(h0, w0), mode="bicubic", antialias=self.interpolate_antialias)
        patch_pos = grid.permute(0, 2, 3, 1).reshape(1, -1, pos.shape[-1])
        return torch.cat([cls_pos, patch_pos], dim=1).to(x.dtype)

    def prepare_tokens(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(b, -1, -1), tokens], dim=1)
        tokens = tokens + self.interpolate_pos_encoding(tokens, h, w)
        if self.register_tokens is not None:
            tokens = torch.cat([tokens[:, :1], self.register_tokens.expand(b, -1, -1), tokens[:, 1:]], dim=1)
        return tokens

    def forward_features(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        tokens = self.prepare_tokens(x)
        for block in self.blocks:
            tokens = block(tokens)
        normed = self.norm(tokens)
        r = self.num_register_tokens
        return {"x_norm_clstoken": normed[:, 0], "x_norm_regtokens": normed[:, 1:r + 1],
                "x_norm_patchtokens": normed[:, r + 1:], "x_prenorm": tokens}

    def get_intermediate_layers(self, x: torch.Tensor, n=1, reshape: bool = False, return_class_token: bool = False,
                                norm: bool = True):
        """DINOv2's API: outputs of the last ``n`` blocks (int) or of the blocks listed in ``n``, in block order;
        each the patch tokens (registers and CLS dropped) after the final norm when ``norm``, [B, P, D] or
        [B, D, h, w] with ``reshape``; with ``return_class_token`` (patch tokens, CLS token [B, D]) pairs."""
        wanted = set(range(len(self.blocks) - n, len(self.blocks))) if isinstance(n, int) else set(n)
        b, _, h, w = x.shape
        tokens, outputs = self.prepare_tokens(x), []
        for i, block in enumerate(self.blocks):
            tokens = block(tokens)
            if i in wanted:
                outputs.append(self.norm(tokens) if norm else tokens)
        if len(outputs) != len(wanted):
            raise ValueError(f"asked for blocks {sorted(wanted)} of a {len(self.blocks)}-block backbone")
        r = self.num_register_tokens
        classes = [out[:, 0] for out in outputs]
        patches = [out[:, r + 1:] for out in outputs]
        if reshape:
            patches = [p.reshape(b, h // self.patch_size, w // self.patch_size, -1).permute(0, 3, 1, 2).contiguous()
                       for p in patches]
        if return_class_token:
            return tuple(zip(patches, classes))
        return tuple(patches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x)["x_norm_clstoken"])


def dinov2_arguments(name: str) -> dict:
    """Constructor arguments of a torch.hub DINOv2 model name, e.g. 'dinov2_vitl14_reg'."""
    key = name[len("dinov2_"):] if name.startswith("dinov2_") else name
    registers = key.endswith("_reg")
    key = key[:-len("_reg")] if registers else key
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown DINOv2 model {name!r}; known: "
                         f"{sorted('dinov2_' + k + s for k in ARCHITECTURES for s in ('', '_reg'))}")
    args = dict(ARCHITECTURES[key], img_size=518, patch_size=14, mlp_ratio=4.0, init_values=1.0,
                num_register_tokens=4 if registers else 0,
                interpolate_antialias=registers, interpolate_offset=0.0 if registers else 0.1)
    return args


def build_dinov2(name: str, **overrides) -> DinoVisionTransformer:
    """DINOv2 backbone for a hub model name with optional argument overrides (e.g. tiny test sizes)."""
    overrides = {k: v for k, v in overrides.items() if k != "pretrained"}
    return DinoVisionTransformer(**{**dinov2_arguments(name), **overrides})
