"""Stage-1 mixture-of-transformers (MoT) flow: the `shape` latent grid and the pose latents (rotation,
translation, scale, translation scale) are separate token streams with their own weights that share the adaLN
modulation and meet in self-attention (shape attends to itself; pose attends to [pose, shape])."""
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

import backends

from ..modules.attention import MultiHeadAttention, MultiHeadRMSNorm, scaled_dot_product_attention
from ..modules.norm import LayerNorm32
from ..modules.transformer import FeedForwardNet
from ..modules.transformer.body import norm_modulated, run_block
from ..modules.utils import Fp16Torso, init_flow_transformer_weights
from .sparse_structure_flow import TimestepEmbedder

# the stream that only attends to itself; every other stream attends to [itself, this stream]
SHAPE_STREAM = "shape"


def stream_layout(modalities: Sequence[str], share: Optional[Mapping[str, Sequence[str]]]) -> Dict[str, List[str]]:
    """Stream name -> the modalities concatenated (in order) into that stream. Modalities that belong to no
    share group come first (each its own stream), then the share groups."""
    share = {k: list(v) for k, v in (share or {}).items()}
    grouped = {m for members in share.values() for m in members}
    for name, members in share.items():
        unknown = [m for m in members if m not in modalities]
        if unknown:
            raise ValueError(f"latent_share_transformer[{name!r}] names unknown modalities {unknown}; "
                             f"latent_mapping has {list(modalities)}")
    layout = {m: [m] for m in modalities if m not in grouped}
    layout.update(share)
    return layout


class MOTSelfAttention(nn.Module):
    """Per-stream qkv/out projections and qk RMS norms; attention pattern of the MoT (see module docstring)."""

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


class MOTModulatedTransformerCrossBlock(nn.Module):
    """DiT cross block with one adaLN modulation shared by all streams and per-stream everything else
    (`latent_names` = the token streams; norms, cross-attention and MLP are ModuleDicts keyed by stream, as
    upstream's). The per-stream steps are upstream's helpers (``_apply_msa``, ``_apply_cross_attn``, ...); the
    norm + modulation and the gated residuals run as fused backend ops with the same arithmetic."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, share_mod: bool = False,
                 latent_names: Optional[Sequence[str]] = None, freeze_shared_parameters: bool = False):
        super().__init__()
        streams = list(latent_names or [])
        self.freeze_shared_parameters = freeze_shared_parameters
        self.streams = list(streams)
        self.use_checkpoint = use_checkpoint
        self.share_mod = share_mod
        self.norm1 = nn.ModuleDict({s: LayerNorm32(channels, elementwise_affine=False, eps=1e-6) for s in streams})
        self.norm2 = nn.ModuleDict({s: LayerNorm32(channels, elementwise_affine=True, eps=1e-6) for s in streams})
        self.norm3 = nn.ModuleDict({s: LayerNorm32(channels, elementwise_affine=False, eps=1e-6) for s in streams})
        self.self_attn = MOTMultiHeadSelfAttention(channels, num_heads, attn_mode=attn_mode, qkv_bias=qkv_bias,
                                                   use_rope=use_rope, qk_rms_norm=qk_rms_norm, latent_names=streams)
        self.cross_attn = nn.ModuleDict({
            s: MultiHeadAttention(channels, ctx_channels=ctx_channels, num_heads=num_heads, type="cross",
                                  qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm_cross) for s in streams})
        self.mlp = nn.ModuleDict({s: FeedForwardNet(channels, mlp_ratio=mlp_ratio) for s in streams})
        if not share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))
            if freeze_shared_parameters:
                self.adaLN_modulation.eval()
                self.adaLN_modulation.requires_grad_(False)

    # upstream's per-stream helpers --------------------------------------------------------------------------
    def _apply_module(self, h: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return module(h)

    def _apply_cross_attn(self, h: torch.Tensor, cross_attn: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return cross_attn(h, context)

    def _apply_msa(self, h: torch.Tensor, scale_msa: torch.Tensor, shift_msa: torch.Tensor) -> torch.Tensor:
        """adaLN modulation before self-attention: h (1 + scale) + shift (per batch element)."""
        return h * (1 + scale_msa.unsqueeze(1)) + shift_msa.unsqueeze(1)

    def _apply_mlp(self, h: torch.Tensor, scale_mlp: torch.Tensor, shift_mlp: torch.Tensor) -> torch.Tensor:
        """adaLN modulation before the MLP."""
        return h * (1 + scale_mlp.unsqueeze(1)) + shift_mlp.unsqueeze(1)

    def _apply_add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + h

    def _apply_multiplication(self, h: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
        """adaLN-Zero gate (per batch element)."""
        return h * multiplier.unsqueeze(1)

    def _moduledict_to_dict(self, module: nn.ModuleDict) -> Dict[str, nn.Module]:
        return dict(module.items())

    def _forward(self, x: Dict[str, torch.Tensor], mod: torch.Tensor, context: torch.Tensor
                 ) -> Dict[str, torch.Tensor]:
        # norm_modulated(norm, h, shift, scale) = _apply_msa / _apply_mlp of norm(h); gated_residual(x, h, g) =
        # _apply_add(x, _apply_multiplication(h, g)): one backend op each, same rounding as the separate ops
        chunks = (mod if self.share_mod else self.adaLN_modulation(mod)).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
        attn = self.self_attn({n: norm_modulated(self.norm1[n], h, shift_msa, scale_msa) for n, h in x.items()})
        cross = self._moduledict_to_dict(self.cross_attn)
        out = {}
        for name, h in x.items():
            h = backends.gated_residual(h, attn[name], gate_msa)
            h = self._apply_add(h, self._apply_cross_attn(norm_modulated(self.norm2[name], h), cross[name], context))
            mlp = self._apply_module(norm_modulated(self.norm3[name], h, shift_mlp, scale_mlp), self.mlp[name])
            out[name] = backends.gated_residual(h, mlp, gate_mlp)
        return out

    def forward(self, x: Dict[str, torch.Tensor], mod: torch.Tensor, context: torch.Tensor) -> Dict[str, torch.Tensor]:
        return run_block(self, x, mod, context)


class MOTSparseStructureFlowModel(Fp16Torso, nn.Module):
    """MoT flow backbone on a dict of latents {name: [B, L_name, C_name]}, returns the velocity dict."""

    def __init__(self, resolution: int, in_channels: int, model_channels: int, cond_channels: int,
                 out_channels: int, num_blocks: int, latent_mapping: Mapping[str, nn.Module],
                 latent_share_transformer: Optional[Mapping[str, Sequence[str]]] = None,
                 num_heads: Optional[int] = None, num_head_channels: int = 64, mlp_ratio: float = 4,
                 patch_size: int = 1, pe_mode: str = "ape", use_fp16: bool = False, use_checkpoint: bool = False,
                 share_mod: bool = False, qk_rms_norm: bool = False, qk_rms_norm_cross: bool = False,
                 is_shortcut_model: bool = False, freeze_d_time_embedder: bool = False,
                 freeze_shared_parameters: bool = False):
        super().__init__()
        if not latent_mapping:
            raise ValueError("latent_mapping must name at least one modality")
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
        self.is_shortcut_model = is_shortcut_model
        self.freeze_d_time_embedder = freeze_d_time_embedder
        self.freeze_shared_parameters = freeze_shared_parameters
        self.latent_share_transformer = {k: list(v) for k, v in (latent_share_transformer or {}).items()}
        self.streams = stream_layout(list(latent_mapping.keys()), latent_share_transformer)

        if is_shortcut_model:
            self.d_embedder = TimestepEmbedder(model_channels)
        self.t_embedder = TimestepEmbedder(model_channels)
        if share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(model_channels, 6 * model_channels, bias=True))
        self.blocks = nn.ModuleList([
            MOTModulatedTransformerCrossBlock(model_channels, cond_channels, num_heads=self.num_heads,
                                              mlp_ratio=mlp_ratio, use_checkpoint=use_checkpoint,
                                              qk_rms_norm=qk_rms_norm, qk_rms_norm_cross=qk_rms_norm_cross,
                                              share_mod=share_mod, latent_names=list(self.streams),
                                              freeze_shared_parameters=freeze_shared_parameters)
            for _ in range(num_blocks)])
        self.latent_mapping = nn.ModuleDict(dict(latent_mapping))
        if use_fp16:
            self.convert_to_fp16()

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.blocks,)

    def _check_latents(self, latents: Mapping[str, torch.Tensor]) -> None:
        missing = [k for k in self.latent_mapping if k not in latents]
        extra = [k for k in latents if k not in self.latent_mapping]
        if missing or extra:
            raise ValueError(f"latent dict keys {sorted(latents)} do not match the model's modalities "
                             f"{sorted(self.latent_mapping)} (missing {missing}, unexpected {extra})")

    def embed_time(self, t: torch.Tensor, d: Optional[torch.Tensor]) -> torch.Tensor:
        t_emb = self.t_embedder(t)
        if d is not None:
            if not self.is_shortcut_model:
                raise ValueError("a step size d was given but the model was built with is_shortcut_model=False")
            t_emb = t_emb + self.d_embedder(d)
        return t_emb

    def initialize_weights(self) -> None:
        """Training initialisation: xavier Linear weights / zero biases, N(0, 0.02) timestep MLP, zero d-embedder
        output weight (d starts as a no-op), zero adaLN output layers."""
        init_flow_transformer_weights(self)
        if self.is_shortcut_model:
            nn.init.zeros_(self.d_embedder.mlp[2].weight)

    @property
    def input_latent_mappings(self) -> List[str]:
        return list(self.latent_mapping)

    def project_input(self, latents_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Every latent through its input adapter, then the share groups concatenated (token dim)."""
        for name in self.input_latent_mappings:
            if name not in latents_dict:
                raise KeyError(f"'{name}' not found in latents_dict")
        embedded = {name: self.latent_mapping[name].to_input(latents_dict[name])
                    for name in self.input_latent_mappings}
        return self.merge_latent_share_transformer(embedded)

    def project_output(self, output: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Inverse of project_input: split the share groups, then every latent through its output head."""
        split = self.split_latent_share_transformer(output)
        return {name: self.latent_mapping[name].to_output(split[name]) for name in self.input_latent_mappings}

    def merge_latent_share_transformer(self, latent_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Stream name -> tokens: share groups (members concatenated in order) first, then the other latents."""
        groups = {s: m for s, m in self.streams.items() if m != [s]}
        out = {s: torch.cat([latent_dict[m] for m in members], dim=1) for s, members in groups.items()}
        grouped = {m for members in groups.values() for m in members}
        out.update({k: v for k, v in latent_dict.items() if k not in grouped and k not in out})
        return out

    def split_latent_share_transformer(self, output_latents: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Share-group tokens cut back into their members (token counts of the members' position embeddings)."""
        out = {}
        for name, h in output_latents.items():
            members = self.streams.get(name, [name])
            if members == [name]:
                out[name] = h
                continue
            lengths = [self.latent_mapping[m].pos_emb.shape[0] for m in members]
            out.update(zip(members, torch.split(h, lengths, dim=1)))
        return out

    def forward(self, latents: Mapping[str, torch.Tensor], t: torch.Tensor, cond: torch.Tensor,
                d: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        self._check_latents(latents)
        if cond.dim() != 3 or cond.shape[-1] != self.cond_channels:
            raise ValueError(f"condition tokens must be [B, L, {self.cond_channels}], got {tuple(cond.shape)}")
        batch = {name: x.shape[0] for name, x in latents.items()}
        if len(set(batch.values()) | {cond.shape[0]}) != 1:
            raise ValueError(f"batch sizes differ: latents {batch}, condition tokens {cond.shape[0]}")
        hs = self.project_input(latents)
        in_dtype = latents[next(iter(self.latent_mapping))].dtype
        hs = self._run_blocks(hs, t, cond, d, in_dtype)
        return self.project_output(hs)

    def _run_blocks(self, hs: Dict[str, torch.Tensor], t: torch.Tensor, cond: torch.Tensor,
                    d: Optional[torch.Tensor], out_dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """The transformer on the stream tokens {stream: [B, L, model_channels]}."""
        t_emb = self.embed_time(t, d)
        if self.share_mod:
            t_emb = self.adaLN_modulation(t_emb)
        dtype = self.compute_dtype(cond.device)
        t_emb = t_emb.type(dtype)
        # the blocks feed the condition tokens only to matmuls: cast them once, not once per block and stream
        cond = cond.type(backends.device.matmul_input_dtype(dtype, cond.device))
        hs = {name: self._cast_type(h, dtype) for name, h in hs.items()}
        for block in self.blocks:
            hs = block(hs, t_emb, cond)
        return {name: self._cast_type(h, out_dtype) for name, h in hs.items()}

    def _cast_type(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stream tokens' cast into and out of the blocks' compute dtype."""
        return x.type(dtype)


class SparseStructureFlowTdfyWrapper(MOTSparseStructureFlowModel):
    """MoT flow as the generator calls it: `model(latents, t, *condition_args, d=None, cfg=False,
    **condition_kwargs)`. Condition tokens come from `condition_embedder(*args, **kwargs)` or, when it is None,
    the single positional condition argument. `cfg=True` (unconditional call) zeroes the condition tokens."""

    def __init__(self, *args, condition_embedder: Optional[nn.Module] = None, force_zeros_cond: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.condition_embedder = condition_embedder
        self.force_zeros_cond = force_zeros_cond

    def get_condition(self, *args, **kwargs) -> torch.Tensor:
        if self.condition_embedder is not None:
            return self.condition_embedder(*args, **kwargs)
        if len(args) != 1 or kwargs:
            raise TypeError(f"without a condition_embedder the model takes exactly one positional condition tensor "
                            f"[B, L, {self.cond_channels}]; got {len(args)} positional and keyword(s) "
                            f"{sorted(kwargs)}")
        return args[0]

    def forward(self, latents: Mapping[str, torch.Tensor], t: torch.Tensor, *condition_args,
                cfg: bool = False, d: Optional[torch.Tensor] = None, **condition_kwargs) -> Dict[str, torch.Tensor]:
        cond = self.get_condition(*condition_args, **condition_kwargs)
        if cfg:
            if not self.force_zeros_cond:
                raise NotImplementedError("the unconditional (cfg=True) call is only defined with "
                                          "force_zeros_cond=True (zeroed condition tokens)")
            # Zeroed tokens are all equal, and attention over equal keys and values gives every query that one
            # value: a single zeroed token computes the same cross-attention (bit for bit in half precision with
            # fewer than 2^13 tokens, within float32 rounding otherwise) at a fraction of its cost, which is
            # most of the unconditional call's attention in stage 1.
            cond = cond[:, :1] * 0
        return super().forward(latents, t, cond, d=d)



class SparseStructureFlowModel(MOTSparseStructureFlowModel):
    """Upstream's MoT backbone interface: forward(h, t, cond, d) on the stream tokens {stream: [B, L, C]}
    (projection in and out is the wrapper's job). The latent adapters come as keyword `latent_mapping` (and
    `latent_share_transformer`), since the stream layout depends on them."""

    def __init__(self, in_channels: int, model_channels: int, cond_channels: int, out_channels: int,
                 num_blocks: int, num_heads: Optional[int] = None, num_head_channels: int = 64, mlp_ratio: float = 4,
                 pe_mode: str = "ape", use_fp16: bool = False, use_checkpoint: bool = False, share_mod: bool = False,
                 qk_rms_norm: bool = False, qk_rms_norm_cross: bool = False, freeze_shared_parameters: bool = False,
                 is_shortcut_model: bool = False, *args, **kwargs):
        super().__init__(kwargs.pop("resolution", None), in_channels, model_channels, cond_channels, out_channels,
                         num_blocks, num_heads=num_heads, num_head_channels=num_head_channels, mlp_ratio=mlp_ratio,
                         pe_mode=pe_mode, use_fp16=use_fp16, use_checkpoint=use_checkpoint, share_mod=share_mod,
                         qk_rms_norm=qk_rms_norm, qk_rms_norm_cross=qk_rms_norm_cross,
                         freeze_shared_parameters=freeze_shared_parameters, is_shortcut_model=is_shortcut_model,
                         **kwargs)

    def forward(self, h: Dict[str, torch.Tensor], t: torch.Tensor, cond: torch.Tensor,
                d: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        dtypes = {x.dtype for x in h.values()}
        if len(dtypes) != 1:
            raise ValueError(f"the stream tokens have different dtypes {sorted(map(str, dtypes))}")
        return self._run_blocks(dict(h), t, cond, d, dtypes.pop())
