"""Plain ViT pieces shared by the DINOv2 backbone and the point-map embedder (timm / DINOv2 state-dict names:
`norm1`, `attn.qkv`, `attn.proj`, `ls1.gamma`, `norm2`, `mlp.fc1`, `mlp.fc2` or `mlp.w12`/`mlp.w3`, `ls2.gamma`).
Attention goes through `backends.attention`."""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import backends


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, proj_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        # None: the registry's choice (ATTN_BACKEND, backends.use); a name pins this module's attention (the
        # torch.hub DINOv2 stand-in pins "auto": DINOv2 never follows SAM 3D's attention variables)
        self.attn_backend: Optional[str] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).unbind(dim=2)
        h = backends.attention(q, k, v, scale=self.scale, backend=self.attn_backend)
        return self.proj(h.reshape(b, n, c))


class Mlp(nn.Module):
    """fc1 -> exact GELU -> fc2."""

    def __init__(self, in_features: int, hidden_features: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLUFFN(nn.Module):
    """DINOv2's fused SwiGLU feed-forward (ViT-g): w12 -> silu(x1) * x2 -> w3; hidden rounded to a multiple of 8."""

    def __init__(self, in_features: int, hidden_features: int, bias: bool = True):
        super().__init__()
        hidden = (int(hidden_features * 2 / 3) + 7) // 8 * 8
        self.w12 = nn.Linear(in_features, 2 * hidden, bias=bias)
        self.w3 = nn.Linear(hidden, in_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class LayerScale(nn.Module):
    """Per-channel residual gain `gamma`."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm ViT block; `init_values=None` gives a block without layer scale (no `ls*` keys)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 proj_bias: bool = True, ffn_bias: bool = True, init_values: Optional[float] = None,
                 ffn_layer: str = "mlp", norm_eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        hidden = int(dim * mlp_ratio)
        if ffn_layer == "mlp":
            self.mlp = Mlp(dim, hidden, bias=ffn_bias)
        elif ffn_layer in ("swiglu", "swiglufused"):
            self.mlp = SwiGLUFFN(dim, hidden, bias=ffn_bias)
        else:
            raise ValueError(f"unknown ffn_layer {ffn_layer!r} (use 'mlp' or 'swiglufused')")
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))
