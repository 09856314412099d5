"""Dense attention layers (self / cross, optional per-head RMS norm on queries and keys, optional RoPE)."""
from typing import Callable, Dict, Literal, Mapping, Optional, Sequence

import torch
import torch.nn as nn

import backends

from ..quantized import QuantizedLinear, dense_weight
from .context_cache import project_context
from .full_attn import scaled_dot_product_attention


class MultiHeadRMSNorm(nn.Module):
    """RMS norm over the head dimension with a per-head gain `gamma` [heads, dim] (computed in float32)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backends.head_rms_norm(x, self.gamma, self.scale)


class RotaryPositionEmbedder(nn.Module):
    """Rotary embedding of integer/float positions [..., in_channels] for heads of size `hidden_size`."""

    def __init__(self, hidden_size: int, in_channels: int = 3):
        super().__init__()
        if hidden_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {hidden_size}")
        self.hidden_size = hidden_size
        self.in_channels = in_channels
        self.freq_dim = hidden_size // in_channels // 2

    @property
    def freqs(self) -> torch.Tensor:
        """[freq_dim] float32 frequencies 1 / 10000^(i / freq_dim) (CPU; computed on use, so that no frequency
        tensor is left on the meta device after an assign=True load)."""
        return self._frequencies("cpu")

    def _frequencies(self, device) -> torch.Tensor:
        exponents = torch.arange(self.freq_dim, dtype=torch.float32, device=device) / self.freq_dim
        return 1.0 / (10000 ** exponents)

    def _get_phases(self, indices: torch.Tensor) -> torch.Tensor:
        phases = torch.outer(indices.float(), self._frequencies(indices.device))
        return torch.polar(torch.ones_like(phases), phases)

    @staticmethod
    def _rotary_embedding(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        """x [..., D] rotated pairwise by the unit complex phases [..., D / 2]."""
        x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_complex * phases).reshape(*x.shape).to(x.dtype)

    _rotate = _rotary_embedding

    def forward(self, q: torch.Tensor, k: torch.Tensor, indices: Optional[torch.Tensor] = None):
        """q, k: [B, L, H, D]; indices: [B, L, in_channels] positions (default: 0..L-1 on one axis)."""
        if indices is None:
            indices = torch.arange(q.shape[1], device=q.device, dtype=torch.float32)
            indices = indices.reshape(1, -1, 1).expand(q.shape[0], -1, 1)
        phases = self._get_phases(indices.reshape(-1)).reshape(*indices.shape[:-1], -1)
        if phases.shape[-1] < self.hidden_size // 2:
            pad = torch.polar(torch.ones(*phases.shape[:-1], self.hidden_size // 2 - phases.shape[-1],
                                         device=phases.device),
                              torch.zeros(*phases.shape[:-1], self.hidden_size // 2 - phases.shape[-1],
                                          device=phases.device))
            phases = torch.cat([phases, pad], dim=-1)
        phases = phases.unsqueeze(-2)  # broadcast over heads
        return self._rotary_embedding(q, phases), self._rotary_embedding(k, phases)


def add_attention_projections(layer: nn.Module, channels: int, num_heads: int, ctx_channels: Optional[int],
                              type: str, qkv_bias: bool, qk_rms_norm: bool, rms_norm: Callable[..., nn.Module]) -> None:
    """Upstream's attention projections on `layer`, dense or sparse: `to_qkv` (self) or `to_q` + `to_kv` (cross),
    optional `q_rms_norm` / `k_rms_norm` (built by `rms_norm(head_dim, heads)`), `to_out`; plus the size attributes
    the forward passes read. Raises on a head count that does not divide `channels` or an unknown `type`."""
    if channels % num_heads:
        raise ValueError(f"channels ({channels}) must be divisible by num_heads ({num_heads})")
    if type not in ("self", "cross"):
        raise ValueError(f"unknown attention type {type!r} (use 'self' or 'cross')")
    layer.channels = channels
    layer.head_dim = channels // num_heads
    layer.ctx_channels = ctx_channels if ctx_channels is not None else channels
    layer.num_heads = num_heads
    layer._type = type
    layer.qk_rms_norm = qk_rms_norm
    if type == "self":
        layer.to_qkv = nn.Linear(channels, channels * 3, bias=qkv_bias)
    else:
        layer.to_q = nn.Linear(channels, channels, bias=qkv_bias)
        layer.to_kv = nn.Linear(layer.ctx_channels, channels * 2, bias=qkv_bias)
    if qk_rms_norm:
        layer.q_rms_norm = rms_norm(layer.head_dim, num_heads)
        layer.k_rms_norm = rms_norm(layer.head_dim, num_heads)
    layer.to_out = nn.Linear(channels, channels)


def single_token_output(layer: nn.Module, context) -> Optional[torch.Tensor]:
    """The cross-attention's output row [B, 1, C] when the context is one token per batch element (the
    unconditional call's zeroed token), else None. A softmax over one key is exactly 1 whatever the query, so
    every query receives that token's value: ``to_out(v)``, one row per batch element, with neither the queries'
    projection and norm nor the attention computed (the values are the same; only the output product runs on one
    row instead of each query's)."""
    if (not isinstance(context, torch.Tensor) or context.dim() != 3 or context.shape[1] != 1
            or context.shape[-1] != layer.ctx_channels):
        return None  # (a context of the wrong width gets the usual path and its error)
    v = layer.to_kv(context)[..., layer.channels:]  # [B, 1, H D]: to_kv's second half (k's norm only touches k)
    return layer.to_out(v)


class MultiHeadAttention(nn.Module):
    _type: str  # "self" or "cross", set by add_attention_projections

    """Self- or cross-attention on dense [B, L, C] tokens.

    State-dict names: self -> `to_qkv`; cross -> `to_q`, `to_kv`; both -> `to_out`, optional
    `q_rms_norm.gamma` / `k_rms_norm.gamma` [heads, head_dim].
    """

    def __init__(self, channels: int, num_heads: int, ctx_channels: Optional[int] = None,
                 type: Literal["self", "cross"] = "self", attn_mode: Literal["full", "windowed"] = "full",
                 window_size: Optional[int] = None, shift_window: Optional[tuple] = None, qkv_bias: bool = True,
                 use_rope: bool = False, qk_rms_norm: bool = False):
        super().__init__()
        if attn_mode != "full":
            raise NotImplementedError("dense MultiHeadAttention supports attn_mode='full' only")
        if type == "cross" and use_rope:
            raise ValueError("RoPE is only defined for self-attention")
        add_attention_projections(self, channels, num_heads, ctx_channels, type, qkv_bias, qk_rms_norm,
                                  rms_norm=MultiHeadRMSNorm)
        self.attn_mode = attn_mode
        self.window_size = window_size
        self.shift_window = shift_window
        self.use_rope = use_rope
        if use_rope:
            self.rope = RotaryPositionEmbedder(channels)

    def _attends_through_context(self, queries: int, context: torch.Tensor) -> bool:
        """Cross-attention of a few queries (stage 1's 4 pose tokens against 7528 condition tokens) skips the
        context's key / value projection (``backends.attention_through_context``: same result up to float
        rounding, a sixteenth of the work there). Where the backends say it pays (``context_shortcut_pays``), with
        dense float weights (a Linear, or bf16 weights; not int8 codes) whose matmuls take the context as it is
        (the same dtype, or the one autocast casts the weight to: bfloat16 sampling), and no key norm (it is not
        linear)."""
        # exact types: a Linear subclass (a user's adapter, another quantiser) may compute otherwise than its weight
        weight = dense_weight(self.to_kv) if type(self.to_kv) in (nn.Linear, QuantizedLinear) else None
        return (backends.context_shortcut_pays(context.device) and not self.qk_rms_norm and weight is not None
                and context.dtype.is_floating_point
                and backends.device.matmul_input_dtype(weight.dtype, context.device) == context.dtype
                and 4 * queries <= self.head_dim)  # the context's rows: queries * heads of width C, not 2 H D

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None,
                indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, l, c = x.shape
        if self._type == "self":
            qkv = self.to_qkv(x).reshape(b, l, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.unbind(dim=2)
            if self.use_rope:
                q, k = self.rope(q, k, indices)
        else:
            if context is None:
                raise ValueError("cross-attention needs a context tensor [B, L_ctx, ctx_channels]")
            row = single_token_output(self, context)
            if row is not None:  # a fresh [B, L, C] tensor: residual sums may add into it in place
                return row.expand(b, l, row.shape[-1]).contiguous()
            q = self.to_q(x).reshape(b, l, self.num_heads, self.head_dim)
            if self._attends_through_context(l, context):
                wk, wv = dense_weight(self.to_kv).chunk(2)
                bv = None if self.to_kv.bias is None else self.to_kv.bias.chunk(2)[1]
                h = backends.attention_through_context(q, context, wk, wv, bv)
                return self.to_out(h.reshape(b, l, -1))
            kv = project_context(self, context).reshape(b, context.shape[1], 2, self.num_heads, self.head_dim)
            k, v = kv.unbind(dim=2)
        if self.qk_rms_norm:
            q = self.q_rms_norm(q)
            k = self.k_rms_norm(k)
        h = scaled_dot_product_attention(q, k, v)
        return self.to_out(h.reshape(b, l, -1))


# ---- mixture-of-transformers (MoT) self-attention of the stage-1 flow (upstream defines it in this module)
# the stream that only attends to itself; every other stream attends to [itself, this stream]
SHAPE_STREAM = "shape"


class MOTSelfAttention(nn.Module):
    """Per-stream qkv/out projections and qk RMS norms; attention pattern of the
    mixture-of-transformers flow: the shape stream attends to itself, every other stream to [itself, shape]."""

    def __init__(self, streams: Sequence[str], channels: int, num_heads: int, qkv_bias: bool = True,
                 qk_rms_norm: bool = False):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"channels ({channels}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = channels // num_heads
        self.qk_rms_norm = qk_rms_norm
        self.to_qkv = nn.ModuleDict({s: nn.Linear(channels, 3 * channels, bias=qkv_bias) for s in streams})
        if qk_rms_norm:
            self.q_rms_norm = nn.ModuleDict({s: MultiHeadRMSNorm(self.head_dim, num_heads) for s in streams})
            self.k_rms_norm = nn.ModuleDict({s: MultiHeadRMSNorm(self.head_dim, num_heads) for s in streams})
        self.to_out = nn.ModuleDict({s: nn.Linear(channels, channels) for s in streams})

    def _project(self, name: str, x: torch.Tensor):
        b, l, _ = x.shape
        q, k, v = self.to_qkv[name](x).reshape(b, l, 3, self.num_heads, self.head_dim).unbind(dim=2)
        if self.qk_rms_norm:
            q = self.q_rms_norm[name](q)
            k = self.k_rms_norm[name](k)
        return q, k, v

    def forward(self, x: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        qkv = {name: self._project(name, h) for name, h in x.items()}
        out = {}
        for name, (q, k, v) in qkv.items():
            if name != SHAPE_STREAM and SHAPE_STREAM in qkv:
                # pose tokens read the shape tokens; no gradient flows back into the shape stream through them
                k = torch.cat([k, qkv[SHAPE_STREAM][1].detach()], dim=1)
                v = torch.cat([v, qkv[SHAPE_STREAM][2].detach()], dim=1)
            h = scaled_dot_product_attention(q, k, v)
            out[name] = self.to_out[name](h.reshape(h.shape[0], h.shape[1], -1))
        return out


class MOTMultiHeadSelfAttention(MOTSelfAttention):
    """Upstream's constructor and helpers for the MoT self-attention (`latent_names` = the streams;
    `protect_modality_list` = the streams that attend only to themselves, here the shape stream). The other
    streams' queries attend together to all other streams' keys and to the protected streams' (detached) keys.
    Only full self-attention exists (upstream raises for the rest too)."""

    _type: str  # "self": the only attention type of the MoT

    def __init__(self, channels: int, num_heads: int, ctx_channels: Optional[int] = None, type: str = "self",
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window=None, qkv_bias: bool = True,
                 use_rope: bool = False, qk_rms_norm: bool = False, latent_names: Optional[Sequence[str]] = None,
                 protect_modality_list: Sequence[str] = ["shape"]):  # noqa: B006 (read only)
        if type != "self" or attn_mode != "full" or use_rope:
            raise ValueError("the MoT attention is full self-attention without RoPE (type='self', attn_mode='full')")
        if not latent_names:
            raise ValueError("latent_names must list the token streams")
        super().__init__(list(latent_names), channels, num_heads, qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm)
        if list(protect_modality_list) != [SHAPE_STREAM]:
            raise ValueError(f"only protect_modality_list=['{SHAPE_STREAM}'] is supported")
        self.channels = channels
        self.ctx_channels = ctx_channels if ctx_channels is not None else channels
        self._type = type
        self.attn_mode = attn_mode
        self.window_size = window_size
        self.shift_window = shift_window
        self.use_rope = use_rope
        self.latent_names = list(latent_names)
        self.protect_modality_list = list(protect_modality_list)

    # upstream's per-stream helpers (the forward maps them over the streams) ----------------------------------
    def _get_shape(self, x: torch.Tensor) -> torch.Size:
        return x.shape

    def _apply_module(self, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return module(x)

    def _moduledict_to_dict(self, module: nn.ModuleDict) -> Dict[str, nn.Module]:
        return dict(module.items())

    def _reshape(self, qkv: torch.Tensor, tensor_shape, num_heads: int) -> torch.Tensor:
        """[B, L, 3 C] -> [B, L, 3, heads, C / heads]."""
        b, length, _ = tensor_shape
        return qkv.reshape(b, length, 3, num_heads, -1)

    def _reshape_back(self, qkv: torch.Tensor, tensor_shape) -> torch.Tensor:
        """[B, L, heads, C / heads] -> [B, L, C]."""
        b, length, _ = tensor_shape
        return qkv.reshape(b, length, -1)

    def unbind_qkv(self, qkv):
        """{stream: [B, L, 3, H, C]} -> ({stream: q}, {stream: k}, {stream: v}); a single tensor -> (q, k, v)."""
        if isinstance(qkv, torch.Tensor):
            return qkv.unbind(dim=2)
        q, k, v = {}, {}, {}
        for name, item in qkv.items():
            q[name], k[name], v[name] = item.unbind(dim=2)
        return q, k, v

    def concatenate_tensor(self, tensor_dict: Mapping[str, torch.Tensor], latent_names: Sequence[str]):
        """Tokens of `latent_names` concatenated (dim 1) and name -> [start, length] token ranges."""
        mapping, start = {}, 0
        for name in latent_names:
            mapping[name] = [start, tensor_dict[name].shape[1]]
            start += tensor_dict[name].shape[1]
        return torch.cat([tensor_dict[n] for n in latent_names], dim=1), mapping

    def unpack_tensors(self, h_others: torch.Tensor, indicies_mapping: Mapping[str, Sequence[int]]):
        return {name: h_others[:, a:a + n] for name, (a, n) in indicies_mapping.items()}

    def mm_scale_dot_product_attention(self, q: Mapping[str, torch.Tensor], k: Mapping[str, torch.Tensor],
                                       v: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Protected streams attend to themselves; the other streams' queries (concatenated) attend to all other
        streams' keys followed by the protected streams' keys, detached (no gradient into the shape stream)."""
        out = {name: scaled_dot_product_attention(q[name], k[name], v[name]) for name in self.protect_modality_list
               if name in q}
        others = [n for n in q if n not in self.protect_modality_list]
        if not others:
            return out
        protected = [n for n in self.protect_modality_list if n in q]
        q_others, ranges = self.concatenate_tensor(q, others)
        k_all = torch.cat([self.concatenate_tensor(k, others)[0]] + [k[n].detach() for n in protected], dim=1)
        v_all = torch.cat([self.concatenate_tensor(v, others)[0]] + [v[n].detach() for n in protected], dim=1)
        out.update(self.unpack_tensors(scaled_dot_product_attention(q_others, k_all, v_all), ranges))
        return out

    def forward(self, x: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        shapes = {name: self._get_shape(h) for name, h in x.items()}
        to_qkv = self._moduledict_to_dict(self.to_qkv)
        qkv = {name: self._reshape(self._apply_module(h, to_qkv[name]), shapes[name], self.num_heads)
               for name, h in x.items()}
        q, k, v = self.unbind_qkv(qkv)
        if self.qk_rms_norm:
            q_norm, k_norm = self._moduledict_to_dict(self.q_rms_norm), self._moduledict_to_dict(self.k_rms_norm)
            q = {name: self._apply_module(t, q_norm[name]) for name, t in q.items()}
            k = {name: self._apply_module(t, k_norm[name]) for name, t in k.items()}
        h = self.mm_scale_dot_product_attention(q, k, v)
        to_out = self._moduledict_to_dict(self.to_out)
        return {name: self._apply_module(self._reshape_back(h[name], shapes[name]), to_out[name]) for name in x}
