"""Stage-2 structured-latent flow: sparse U-shaped DiT (res blocks at 64^3, transformer at 32^3)."""
from typing import Any, List, Optional, Tuple

import weakref

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import backends

from ..modules import sparse as sp
from ..modules.attention.context_cache import condition_for_blocks
from ..modules.sparse.attention.full_attn import varlen_layout
from ..modules.norm import LayerNorm32
from ..modules.transformer import AbsolutePositionEmbedder
from ..modules.utils import Fp16Torso, init_flow_transformer_weights, zero_module
from .sparse_structure_flow import TimestepEmbedder

__all__ = ["SparseResBlock3d", "SLatFlowModel", "SLatFlowModelTdfyWrapper"]


class SparseResBlock3d(nn.Module):
    """x = updown(x); h = conv1(silu(LN(x))); h = LN_noaffine(h) * (1 + scale) + shift (from emb);
    h = conv2(silu(h)); out = h + skip(x)."""

    def __init__(self, channels: int, emb_channels: int, out_channels: Optional[int] = None,
                 downsample: bool = False, upsample: bool = False):
        super().__init__()
        if downsample and upsample:
            raise ValueError("a SparseResBlock3d cannot both downsample and upsample")
        self.channels = channels
        self.emb_channels = emb_channels
        self.out_channels = out_channels or channels
        self.downsample = downsample
        self.upsample = upsample
        self.norm1 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.norm2 = LayerNorm32(self.out_channels, elementwise_affine=False, eps=1e-6)
        self.conv1 = sp.SparseConv3d(channels, self.out_channels, 3)
        self.conv2 = zero_module(sp.SparseConv3d(self.out_channels, self.out_channels, 3))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * self.out_channels, bias=True))
        self.skip_connection = (sp.SparseLinear(channels, self.out_channels) if channels != self.out_channels
                                else nn.Identity())
        self.updown = sp.SparseDownsample(2) if downsample else sp.SparseUpsample(2) if upsample else None

    def _updown(self, x: sp.SparseTensor) -> sp.SparseTensor:
        """The block's 2x down- or upsampling (identity for a plain block)."""
        return self.updown(x) if self.updown is not None else x

    def forward(self, x: sp.SparseTensor, emb: torch.Tensor) -> sp.SparseTensor:
        scale, shift = self.emb_layers(emb).type(x.dtype).chunk(2, dim=1)
        if self.upsample and not _hooked(self.norm1, self.conv1, self.skip_connection, self.updown):
            h, skip = self._upsampling_first_half(x)
        else:
            x = self._updown(x)
            h = self.conv1(x.replace(F.silu(self.norm1(x.feats))))
            skip = self.skip_connection(x)
        h = h.replace(self.norm2(h.feats)) * (1 + scale) + shift
        h = self.conv2(h.replace(F.silu(h.feats)))
        return h + skip

    def _upsampling_first_half(self, x: sp.SparseTensor) -> Tuple[sp.SparseTensor, sp.SparseTensor]:
        """(conv1(silu(norm1(up(x)))), skip_connection(up(x))) of an upsampling block, computed on the coarse rows:
        the upsampling copies each coarse row to its fine voxels, and the norm, the SiLU and the skip's linear
        layer act row by row, so they commute with it (the same values on a fifth of the rows at a 2x upsampling
        of a shell); conv1 takes the coarse rows through ``SparseConv3d.forward_upsampled``, which never builds
        the fine [N, Cin] features (stage 2's first output block: 2048 channels on 20k voxels)."""
        h = x.replace(F.silu(self.norm1(x.feats)))
        skip = self.updown(self.skip_connection(x))
        return self.conv1.forward_upsampled(h, skip, self.updown.parent_index(x)), skip


def _hooked(*modules: nn.Module) -> bool:
    """Whether any of ``modules`` has forward hooks, which expect the layers to be called one by one on the
    upsampled voxels as upstream calls them."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def check_sparse_input(x: sp.SparseTensor, channels: int, resolution: int, what: str) -> None:
    """Clear errors for inputs the model cannot handle."""
    if x.feats.dim() != 2 or x.feats.shape[1] != channels:
        raise ValueError(f"{what} expects sparse feats [N, {channels}], got {tuple(x.feats.shape)}")
    if x.coords.shape[0] == 0:
        raise ValueError(f"{what} got an empty sparse tensor (0 voxels)")
    checked = f"coords_in_range_{resolution}"
    if x.get_spatial_cache(checked):
        return  # reading coordinate values costs a host sync: once per coordinate set, not at every step
    spatial = x.coords[:, 1:]
    if bool((spatial < 0).any()) or bool((spatial >= resolution).any()):
        raise ValueError(f"{what}: voxel coords must lie in [0, {resolution}) (the model's resolution); got range "
                         f"[{int(spatial.min())}, {int(spatial.max())}]")
    x.register_spatial_cache(checked, True)


class SLatFlowModel(Fp16Torso, nn.Module):
    def __init__(self, resolution: int, in_channels: int, model_channels: int, cond_channels: int,
                 out_channels: int, num_blocks: int, num_heads: Optional[int] = None, num_head_channels: int = 64,
                 mlp_ratio: float = 4, patch_size: int = 2, num_io_res_blocks: int = 2,
                 io_block_channels: Optional[List[int]] = None, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, use_skip_connection: bool = True, share_mod: bool = False,
                 qk_rms_norm: bool = False, qk_rms_norm_cross: bool = False, is_shortcut_model: bool = False):
        super().__init__()
        self.is_shortcut_model = is_shortcut_model
        self.resolution = resolution
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.cond_channels = cond_channels
        self.out_channels = out_channels
        self.num_blocks = num_blocks
        self.num_heads = num_heads or model_channels // num_head_channels
        self.mlp_ratio = mlp_ratio
        self.patch_size = patch_size
        self.num_io_res_blocks = num_io_res_blocks
        self.io_block_channels = list(io_block_channels)
        self.pe_mode = pe_mode
        self.use_fp16 = use_fp16
        self.use_checkpoint = use_checkpoint
        self.use_skip_connection = use_skip_connection
        self.share_mod = share_mod
        self.qk_rms_norm = qk_rms_norm
        self.qk_rms_norm_cross = qk_rms_norm_cross
        if 2 ** len(self.io_block_channels) != patch_size:
            raise ValueError(f"patch_size ({patch_size}) must be 2 ** len(io_block_channels) "
                             f"({len(self.io_block_channels)} levels)")
        if pe_mode not in ("ape",):
            raise NotImplementedError(f"pe_mode {pe_mode!r} is not implemented (the released model uses 'ape')")

        if is_shortcut_model:  # embeds the shortcut step size d (registered before t_embedder, as upstream)
            self.d_embedder = TimestepEmbedder(model_channels)
        self.t_embedder = TimestepEmbedder(model_channels)
        if share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(model_channels, 6 * model_channels, bias=True))
        self.pos_embedder = AbsolutePositionEmbedder(model_channels)
        chans = self.io_block_channels
        self.input_layer = sp.SparseLinear(in_channels, chans[0])
        self.input_blocks = nn.ModuleList()
        for chs, next_chs in zip(chans, chans[1:] + [model_channels]):
            self.input_blocks.extend(SparseResBlock3d(chs, model_channels, out_channels=chs)
                                     for _ in range(num_io_res_blocks - 1))
            self.input_blocks.append(SparseResBlock3d(chs, model_channels, out_channels=next_chs, downsample=True))
        self.blocks = nn.ModuleList([
            sp.ModulatedSparseTransformerCrossBlock(
                model_channels, cond_channels, num_heads=self.num_heads, mlp_ratio=mlp_ratio, attn_mode="full",
                use_checkpoint=use_checkpoint, share_mod=share_mod, qk_rms_norm=qk_rms_norm,
                qk_rms_norm_cross=qk_rms_norm_cross)
            for _ in range(num_blocks)])
        skip_mult = 2 if use_skip_connection else 1
        self.out_blocks = nn.ModuleList()
        for chs, prev_chs in zip(reversed(chans), [model_channels] + list(reversed(chans[1:]))):
            self.out_blocks.append(SparseResBlock3d(prev_chs * skip_mult, model_channels, out_channels=chs,
                                                    upsample=True))
            self.out_blocks.extend(SparseResBlock3d(chs * skip_mult, model_channels, out_channels=chs)
                                   for _ in range(num_io_res_blocks - 1))
        self.out_layer = sp.SparseLinear(chans[0], out_channels)
        if use_fp16:
            self.convert_to_fp16()

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.input_blocks, self.blocks, self.out_blocks)

    def initialize_weights(self) -> None:
        """Training initialisation: xavier Linear weights / zero biases, N(0, 0.02) timestep MLP, zero adaLN and
        output layers (the d embedder keeps the xavier init, as upstream)."""
        init_flow_transformer_weights(self)
        nn.init.zeros_(self.out_layer.weight)
        nn.init.zeros_(self.out_layer.bias)

    def forward(self, x: sp.SparseTensor, t: torch.Tensor, cond: torch.Tensor,
                d: Optional[torch.Tensor] = None) -> sp.SparseTensor:
        """d: the shortcut step size (time units, like t); needs is_shortcut_model=True."""
        return self._forward(x, t, cond, d)

    def _forward(self, x: sp.SparseTensor, t: torch.Tensor, cond: torch.Tensor, d: Optional[torch.Tensor],
                 transformer: bool = True) -> sp.SparseTensor:
        """``transformer=False`` skips the transformer blocks' work but builds what they read from the
        coordinates (see `prepare_graph_capture`)."""
        check_sparse_input(x, self.in_channels, self.resolution, type(self).__name__)
        dtype = self.compute_dtype(x.device)
        h = self.input_layer(x).type(dtype)
        t_emb = self.t_embedder(t)
        if d is not None:
            if not self.is_shortcut_model:
                raise ValueError("a step size d was given but the model was built with is_shortcut_model=False")
            t_emb = t_emb + self.d_embedder(d)
        if self.share_mod:
            t_emb = self.adaLN_modulation(t_emb)
        if t_emb.shape[0] == 1 and x.shape[0] > 1:
            t_emb = t_emb.expand(x.shape[0], -1)
        t_emb = t_emb.type(dtype)
        # the blocks feed the condition tokens only to matmuls: cast them once to what those matmuls read (under
        # CPU autocast bf16, not float32 cast again by every block's key / value projection)
        cond = condition_for_blocks(self, cond, backends.device.matmul_input_dtype(dtype, cond.device))
        if cond.shape[0] != x.shape[0]:
            raise ValueError(f"cond has {cond.shape[0]} batch elements but the sparse tensor has {x.shape[0]}")

        skips = []
        for block in self.input_blocks:
            h = block(h, t_emb)
            skips.append(h.feats)
        h = h + self.pos_embedder(h.coords[:, 1:]).type(dtype)
        if transformer:
            for block in self.blocks:
                h = block(h, t_emb, cond)
        else:
            varlen_layout(h)  # the blocks' attention over each batch element's voxels
        for block, skip in zip(self.out_blocks, reversed(skips)):
            if self.use_skip_connection:
                h = h.replace(torch.cat([h.feats, skip], dim=1))
            h = block(h, t_emb)
        h = h.replace(backends.layer_norm(h.feats, h.feats.shape[-1:]))
        return self.out_layer(h.type(x.dtype))


class SLatFlowModelTdfyWrapper(SLatFlowModel):
    """The generator's interface: ``forward(x [1, N, C_in], t, *condition_args, cfg=False, **condition_kwargs)``.

    The last positional condition argument is the voxel coords (numpy or tensor int32 [N, 4], b/x/y/z); the others
    (and the kwargs) are the condition: the condition tokens [B, L, cond_channels] themselves, or the inputs of
    ``condition_embedder`` when one is given. ``cfg=True`` asks for the unconditional branch: with
    ``force_zeros_cond`` the condition tokens are multiplied by 0. Returns dense [1, N, out_channels] in the order
    of the coords.
    """

    def __init__(self, *args, condition_embedder: Optional[nn.Module] = None, force_zeros_cond: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.condition_embedder = condition_embedder
        self.force_zeros_cond = force_zeros_cond

    def _condition(self, condition_args, condition_kwargs, cfg: bool) -> torch.Tensor:
        if self.condition_embedder is not None:
            cond = self.condition_embedder(*condition_args, **condition_kwargs)
        else:
            if len(condition_args) != 1 or condition_kwargs:
                raise ValueError("without a condition_embedder the condition must be exactly the condition tokens "
                                 "[B, L, C] (followed by the coords)")
            cond = condition_args[0]
        if cfg:
            if not self.force_zeros_cond:
                raise ValueError("cfg=True needs force_zeros_cond=True (the unconditional branch zeroes the "
                                 "condition tokens)")
            # the condition tokens only reach the blocks' cross-attention, where zeroed tokens are equal keys and
            # values: one of them gives every voxel the same attention output as all of them (within float32
            # rounding) for none of the cost of attending to them
            cond = cond[:, :1] * 0
        return cond

    def unconditional_arguments(self, condition_args: tuple, condition_kwargs: dict
                                ) -> Optional[Tuple[tuple, dict]]:
        """Arguments whose ordinary call computes the cfg=True call on ``condition_args`` / ``condition_kwargs``:
        the condition tokens times 0, as ``force_zeros_cond`` does inside (a CUDA-graph runner then serves both
        guidance branches with one graph). None where the tokens come from a condition_embedder."""
        if self.condition_embedder is not None or not self.force_zeros_cond or not condition_args \
                or not isinstance(condition_args[0], torch.Tensor):
            return None
        return (condition_args[0] * 0, *condition_args[1:]), dict(condition_kwargs)

    def forward(self, x: torch.Tensor, t: torch.Tensor, *condition_args: Any, cfg: bool = False,
                **condition_kwargs: Any) -> torch.Tensor:
        sparse_x, cond, d = self._arguments(x, condition_args, dict(condition_kwargs), cfg)
        return self._forward(sparse_x, t, cond, d).feats[None]

    def prepare_graph_capture(self, x: torch.Tensor, t: torch.Tensor, *condition_args: Any, cfg: bool = False,
                              **condition_kwargs: Any) -> None:
        """Builds every coordinate-derived tensor of this call (the step input kept with the coords, range check,
        neighbour maps, downsampling index, attention sequence lengths), which needs host syncs, without the
        transformer's work. A CUDA-graph runner calls it so that it can capture a call on new coords without an
        eager warm-up call (the residual blocks run once, eagerly; their result is discarded)."""
        sparse_x, cond, d = self._arguments(x, condition_args, dict(condition_kwargs), cfg)
        self._forward(sparse_x, t, cond, d, transformer=False)

    def _arguments(self, x: torch.Tensor, condition_args: tuple, condition_kwargs: dict, cfg: bool
                   ) -> Tuple["sp.SparseTensor", torch.Tensor, Optional[torch.Tensor]]:
        """(sparse input, condition tokens, step size d) of a forward call's arguments."""
        d = condition_kwargs.pop("d", None)
        if "coords" in condition_kwargs:  # upstream's keyword form
            coords = condition_kwargs.pop("coords")
        elif condition_args:
            coords, condition_args = condition_args[-1], condition_args[:-1]
        else:
            raise ValueError("SLatFlowModelTdfyWrapper needs the condition and, last, the voxel coords [N, 4]")
        if x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f"x must be dense feats [1, N, C] (all batch elements packed), got {tuple(x.shape)}")
        cond = self._condition(condition_args, condition_kwargs, cfg)
        return self._sparse_input(x[0], coords), cond, d

    def _sparse_input(self, feats: torch.Tensor, coords: Any) -> "sp.SparseTensor":
        """The SparseTensor of this step. The sampler passes the same coords object at every step of a run, so the
        tensor built at the first step is reused (``replace``): its neighbour maps and other coordinate-derived
        data are computed once per run instead of once per backbone call."""
        cached = getattr(self, "_step_input", None)
        if cached is not None and cached[0]() is coords and cached[1].coords.shape[0] == feats.shape[0] \
                and cached[1].coords.device == feats.device:
            return cached[1].replace(feats)
        source = coords
        if isinstance(coords, np.ndarray):
            coords = torch.from_numpy(np.ascontiguousarray(coords))
        coords = coords.to(device=feats.device, dtype=torch.int32)
        sparse_x = sp.SparseTensor(feats=feats, coords=coords)
        try:
            self._step_input = (weakref.ref(source), sparse_x)
        except TypeError:  # objects without weak references (e.g. lists): no reuse
            self._step_input = None
        return sparse_x
