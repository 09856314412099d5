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


def norm_layer(norm_type: str, channels: int) -> nn.Module:
    if norm_type == "group":
        return GroupNorm32(32, channels)
    if norm_type == "layer":
        return ChannelLayerNorm32(channels)
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
                 use_fp16: bool = False):
        super().__init__()
        if not channels:
            raise ValueError("channels must list at least one width")
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def __init__(self, *args, reshape_input_to_cube: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reshape_input_to_cube = reshape_input_to_cube

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reshape_input_to_cube and x.dim() == 3:
            b, n, c = x.shape
            r = round(n ** (1 / 3))
            if r ** 3 != n:
                raise ValueError(f"{n} tokens do not form a cube")
            x = x.permute(0, 2, 1).reshape(b, c, r, r, r)
        return super().forward(x)
