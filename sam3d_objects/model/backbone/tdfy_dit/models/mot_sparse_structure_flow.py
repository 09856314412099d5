"""Stage-1 mixture-of-transformers (MoT) flow: the `shape` latent grid and the pose latents (rotation,
translation, scale, translation scale) are separate token streams with their own weights that share the adaLN
modulation and meet in self-attention (shape attends to itself; pose attends to [pose, shape])."""
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

import backends

# the MoT layers live in upstream's modules; re-exported here, where upstream's MoT flow model file had them too
from ..modules.attention.context_cache import condition_for_blocks
from ..modules.attention.modules import SHAPE_STREAM, MOTMultiHeadSelfAttention, MOTSelfAttention  # noqa: F401
from ..modules.transformer.modulated import MOTModulatedTransformerCrossBlock
from ..modules.utils import Fp16Torso, init_flow_transformer_weights
from .sparse_structure_flow import TimestepEmbedder


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
        cond = condition_for_blocks(self, cond, backends.device.matmul_input_dtype(dtype, cond.device))
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
