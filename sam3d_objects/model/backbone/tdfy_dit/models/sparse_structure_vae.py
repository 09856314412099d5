"""Dense sparse-structure VAE decoder: latent grid [B, 8, r, r, r] -> occupancy logits [B, 1, 4r, 4r, 4r].

Every stride-1 3D convolution goes through `backends.dense_conv3d` (see `Conv3d`): Conv3d is known to return
wrong values on MPS, and the device workaround lives in backends/dense_conv.py.
"""
from typing import List, Literal, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import backends

from ..modules.norm import ChannelLayerNorm32, GroupNorm32
from ..modules.spatial import pixel_shuffle_3d
from ..modules.utils import Fp16Torso, zero_module


class Conv3d(nn.Conv3d):
    """nn.Conv3d (same parameters and state-dict keys) whose forward goes through `backends.dense_conv3d`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != (1, 1, 1) or self.dilation != (1, 1, 1) or self.groups != 1 \
                or self.padding_mode != "zeros" or isinstance(self.padding, str):
            return super().forward(x)
        return backends.dense_conv3d(x, self.weight, self.bias, self.padding)


def norm_layer(norm_type: str, *args, **kwargs) -> nn.Module:
    """"group" -> GroupNorm32(32 groups, *args), "layer" -> ChannelLayerNorm32(*args); extra arguments (eps...)
    go to the norm."""
    if norm_type == "group":
        return GroupNorm32(32, *args, **kwargs)
    if norm_type == "layer":
        return ChannelLayerNorm32(*args, **kwargs)
    raise ValueError(f"unknown norm_type {norm_type!r} (use 'group' or 'layer')")


class ResBlock3d(nn.Module):
    """norm -> SiLU -> conv -> norm -> SiLU -> conv, plus a (1x1 conv when channels change) skip."""

    def __init__(self, channels: int, out_channels: Optional[int] = None, norm_type: str = "layer"):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.norm1 = norm_layer(norm_type, channels)
        self.norm2 = norm_layer(norm_type, self.out_channels)
        self.conv1 = Conv3d(channels, self.out_channels, 3, padding=1)
        self.conv2 = zero_module(Conv3d(self.out_channels, self.out_channels, 3, padding=1))
        self.skip_connection = (Conv3d(channels, self.out_channels, 1) if channels != self.out_channels
                                else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip_connection(x)


class DownsampleBlock3d(nn.Module):
    """Halve the resolution: stride-2 conv ('conv') or 2x average pooling ('avgpool')."""

    def __init__(self, in_channels: int, out_channels: int, mode: Literal["conv", "avgpool"] = "conv"):
        super().__init__()
        if mode not in ("conv", "avgpool"):
            raise ValueError(f"unknown downsample mode {mode!r}")
        if mode == "avgpool" and in_channels != out_channels:
            raise ValueError("avgpool downsampling keeps the channel count")
        self.mode = mode
        if mode == "conv":
            self.conv = nn.Conv3d(in_channels, out_channels, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if self.mode == "conv" else F.avg_pool3d(x, 2)


class UpsampleBlock3d(nn.Module):
    """Double the resolution: conv to out*8 channels then 3D pixel shuffle ('conv'), or nearest ('nearest')."""

    def __init__(self, in_channels: int, out_channels: int, mode: Literal["conv", "nearest"] = "conv"):
        super().__init__()
        if mode not in ("conv", "nearest"):
            raise ValueError(f"unknown upsample mode {mode!r}")
        if mode == "nearest" and in_channels != out_channels:
            raise ValueError("nearest upsampling keeps the channel count")
        self.mode = mode
        if mode == "conv":
            self.conv = Conv3d(in_channels, out_channels * 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "conv":
            return pixel_shuffle_3d(self.conv(x), 2)
        return F.interpolate(x, scale_factor=2, mode="nearest")


class SparseStructureDecoder(Fp16Torso, nn.Module):
    """Latent grid -> occupancy logits; one 2x pixel-shuffle upsampling between consecutive `channels`."""

    def __init__(self, out_channels: int, latent_channels: int, num_res_blocks: int, channels: List[int],
                 num_res_blocks_middle: int = 2, norm_type: Literal["group", "layer"] = "layer",
                 reshape_input_to_cube: bool = False, use_fp16: bool = False):
        super().__init__()
        if not channels:
            raise ValueError("channels must list at least one width")
        self.reshape_input_to_cube = reshape_input_to_cube
        self.out_channels = out_channels
        self.latent_channels = latent_channels
        self.num_res_blocks = num_res_blocks
        self.channels = list(channels)
        self.num_res_blocks_middle = num_res_blocks_middle
        self.norm_type = norm_type
        self.use_fp16 = use_fp16

        self.input_layer = Conv3d(latent_channels, self.channels[0], 3, padding=1)
        self.middle_block = nn.Sequential(*[ResBlock3d(self.channels[0], self.channels[0], norm_type=norm_type)
                                            for _ in range(num_res_blocks_middle)])
        blocks = []
        for i, ch in enumerate(self.channels):
            blocks += [ResBlock3d(ch, ch, norm_type=norm_type) for _ in range(num_res_blocks)]
            if i < len(self.channels) - 1:
                blocks.append(UpsampleBlock3d(ch, self.channels[i + 1]))
        self.blocks = nn.ModuleList(blocks)
        self.out_layer = nn.Sequential(norm_layer(norm_type, self.channels[-1]), nn.SiLU(),
                                       Conv3d(self.channels[-1], out_channels, 3, padding=1))
        if use_fp16:
            self.convert_to_fp16()

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.blocks, self.middle_block)

    @staticmethod
    def flat_to_cube(flat_latent: torch.Tensor) -> torch.Tensor:
        """Tokens [B, k^3, C] (x-major) -> grid [B, C, k, k, k]."""
        b, n, c = flat_latent.shape
        k = round(n ** (1 / 3))
        if k ** 3 != n:
            raise ValueError(f"Flat latent must be a cube: {n} tokens")
        return flat_latent.view(b, k, k, k, c).permute(0, 4, 1, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reshape_input_to_cube and x.dim() == 3:
            x = self.flat_to_cube(x)
        if x.dim() != 5 or x.shape[1] != self.latent_channels:
            raise ValueError(f"expected a latent grid [B, {self.latent_channels}, r, r, r], got {tuple(x.shape)}")
        h = self.input_layer(x)
        h = h.type(self.compute_dtype(x.device))
        h = self.middle_block(h)
        for block in self.blocks:
            h = block(h)
        h = h.type(x.dtype)
        return self.out_layer(h)


class SparseStructureDecoderTdfyWrapper(SparseStructureDecoder):
    """Decoder as the pipeline builds it; `reshape_input_to_cube=True` also accepts tokens [B, r^3, C]."""

    def __init__(self, *args, pretrained_ckpt_path: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        load_pretrained(self, pretrained_ckpt_path, "SS decoder")


def load_pretrained(model: nn.Module, path: Optional[str], what: str, missing_ok: bool = False) -> None:
    """Strictly load `path` (.safetensors, or a weights-only torch file) into `model`; None loads nothing."""
    if path is None:
        return
    import os
    if not os.path.exists(path):
        if missing_ok:
            return
        raise FileNotFoundError(f"The path for the {what} does not exist: {path}")
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file
        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)


def gaussian_posterior(mean: torch.Tensor, logvar: torch.Tensor, sample_posterior: bool) -> torch.Tensor:
    """z = mean + exp(logvar / 2) * N(0, 1) when sampling, else the mean."""
    if not sample_posterior:
        return mean
    return mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)


class SparseStructureEncoder(Fp16Torso, nn.Module):
    """Occupancy grid [B, C, R, R, R] -> latent Gaussian over [B, latent, R / 2^(n-1), ...]; the decoder's mirror.
    The res blocks use the "layer" norm whatever `norm_type` says (only the output norm follows it, as upstream)."""

    def __init__(self, in_channels: int, latent_channels: int, num_res_blocks: int, channels: List[int],
                 num_res_blocks_middle: int = 2, norm_type: Literal["group", "layer"] = "layer",
                 use_fp16: bool = False):
        super().__init__()
        if not channels:
            raise ValueError("channels must list at least one width")
        self.in_channels = in_channels
        self.latent_channels = latent_channels
        self.num_res_blocks = num_res_blocks
        self.channels = list(channels)
        self.num_res_blocks_middle = num_res_blocks_middle
        self.norm_type = norm_type
        self.use_fp16 = use_fp16

        self.input_layer = Conv3d(in_channels, self.channels[0], 3, padding=1)
        blocks = []
        for i, ch in enumerate(self.channels):
            blocks += [ResBlock3d(ch, ch) for _ in range(num_res_blocks)]
            if i < len(self.channels) - 1:
                blocks.append(DownsampleBlock3d(ch, self.channels[i + 1]))
        self.blocks = nn.ModuleList(blocks)
        self.middle_block = nn.Sequential(*[ResBlock3d(self.channels[-1], self.channels[-1])
                                            for _ in range(num_res_blocks_middle)])
        self.out_layer = nn.Sequential(norm_layer(norm_type, self.channels[-1]), nn.SiLU(),
                                       Conv3d(self.channels[-1], 2 * latent_channels, 3, padding=1))
        if use_fp16:
            self.convert_to_fp16()

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.blocks, self.middle_block)

    def forward(self, x: torch.Tensor, sample_posterior: bool = False, return_raw: bool = False):
        """z (and, with return_raw, (z, mean, logvar)); the torso runs in the one dtype policy of Fp16Torso."""
        x = x.float()
        h = self.input_layer(x).type(self.compute_dtype(x.device))
        for block in self.blocks:
            h = block(h)
        h = self.middle_block(h).type(x.dtype)
        mean, logvar = self.out_layer(h).chunk(2, dim=1)
        z = gaussian_posterior(mean, logvar, sample_posterior)
        return (z, mean, logvar) if return_raw else z


class SparseStructureEncoderTdfyWrapper(SparseStructureEncoder):
    """forward(x) -> {"z", "mean", "logvar"} (or {"z"}); give the encoder's own arguments by keyword."""

    def __init__(self, sample_posterior: bool = True, return_raw: bool = True, *args,
                 pretrained_ckpt_path: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        load_pretrained(self, pretrained_ckpt_path, "SS encoder")
        self.sample_posterior = sample_posterior
        self.return_raw = return_raw

    def forward(self, x: torch.Tensor) -> dict:
        z, mean, logvar = super().forward(x, sample_posterior=self.sample_posterior, return_raw=True)
        return {"z": z, "mean": mean, "logvar": logvar} if self.return_raw else {"z": z}
