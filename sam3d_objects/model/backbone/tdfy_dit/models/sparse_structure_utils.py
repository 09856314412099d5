"""Post-processing of the occupied voxels decoded by stage 1 (the pipeline's `prune_sparse_structure` and
`downsample_sparse_structure`; `sam3d_objects.pipeline.inference_utils` re-exports them)."""
from typing import Tuple

import torch
import torch.nn.functional as F


def _check_coords(coords: torch.Tensor) -> None:
    if not isinstance(coords, torch.Tensor) or coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"coords must be an integer tensor [N, 4] (batch, x, y, z), got "
                         f"{getattr(coords, 'shape', type(coords))}")
    if coords.dtype.is_floating_point:
        raise TypeError(f"coords must be integers, got {coords.dtype}")


def prune_sparse_structure(coords: torch.Tensor, max_neighbor_axes_dist: int = 1) -> torch.Tensor:
    """Drop interior voxels: those whose (2d+1)^3 neighbourhood (d = max_neighbor_axes_dist, space outside the
    grid counts as empty) is completely occupied. Kept voxels stay in their input order."""
    _check_coords(coords)
    if coords.shape[0] == 0 or max_neighbor_axes_dist <= 0:
        return coords
    d = int(max_neighbor_axes_dist)
    c = coords.long()
    lo = c.min(dim=0).values
    c = c - lo  # shift so the grid starts at 0 (batch index included)
    extent = (c.max(dim=0).values + 1).tolist()
    empty = torch.ones(extent, dtype=torch.float32, device=coords.device)
    empty[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] = 0.0
    # pad with "empty" so that voxels on the border always have an empty neighbour outside the grid
    empty = F.pad(empty, (d, d, d, d, d, d), value=1.0)
    any_empty = F.max_pool3d(empty.unsqueeze(1), kernel_size=2 * d + 1, stride=1).squeeze(1)
    keep = any_empty[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] > 0
    return coords[keep]


def downsample_sparse_structure(coords: torch.Tensor, max_coords: int = 42000,
                                downsample_factor: int = 2) -> Tuple[torch.Tensor, int]:
    """If there are more than `max_coords` voxels, shrink the occupied box by `downsample_factor` about its centre
    (per axis: size = max - min + 1, c -> (c - min) / (max - min) * (size/f - 1) + min + (size - size/f) / 2,
    rounded half-to-even, clamped to the integer part of the shrunken box), deduplicate (sorted rows), and if still too many keep a random subset
    (torch.randperm). Returns (coords, factor); factor is 1 when nothing was done."""
    _check_coords(coords)
    if coords.shape[0] <= max_coords:
        return coords, 1
    xyz = coords[:, 1:].float()
    lo = xyz.min(dim=0).values
    hi = xyz.max(dim=0).values
    size = hi - lo + 1
    target = size / downsample_factor
    span = (hi - lo).clamp(min=1.0)  # a flat axis (max == min) stays where it is
    scaled = (xyz - lo) / span * (target - 1) + lo + (size - target) / 2
    # the shrunken box [new_lo, new_hi] is fractional when size/f is; clamping to its integer part keeps the
    # result inside it (a voxel rounded up past new_hi merges with its neighbour)
    new_lo = lo + (size - target) / 2
    new_hi = new_lo + target - 1
    scaled = torch.round(scaled)
    scaled = torch.minimum(torch.maximum(scaled, torch.floor(new_lo)), torch.floor(new_hi))
    out = torch.cat([coords[:, :1], scaled.to(coords.dtype)], dim=1)
    out = torch.unique(out, dim=0)
    if out.shape[0] > max_coords:
        out = out[torch.randperm(out.shape[0], device=out.device)[:max_coords]]
    return out, downsample_factor
