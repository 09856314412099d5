"""Normalisation layers that always compute in float32 (the fp16 torsos keep their norms exact).

The arithmetic goes through `backends.layer_norm` / `backends.group_norm` (the registry's norm family: native
kernels unless ``NORM_BACKEND`` / ``backends.use(norm=...)`` names another).
"""
import torch
import torch.nn as nn

import backends


class LayerNorm32(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the input dtype; the result is cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backends.float32_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in float32 whatever the input dtype; the result is cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backends.group_norm(x.float(), self.num_groups, self.weight, self.bias, self.eps).type(x.dtype)


class ChannelLayerNorm32(LayerNorm32):
    """LayerNorm over the channel axis (dim 1) of a [B, C, *spatial] tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = x.dim()
        to_last = [0, *range(2, dims), 1]
        to_first = [0, dims - 1, *range(1, dims - 1)]
        return super().forward(x.permute(*to_last).contiguous()).permute(*to_first).contiguous()
