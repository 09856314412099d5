"""Dense 3D reshuffles: pixel shuffle and patchify for [B, C, X, Y, Z] grids."""
import torch


def pixel_shuffle_3d(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[B, C*s^3, X, Y, Z] -> [B, C, X*s, Y*s, Z*s]; channel index decomposed as (C, sx, sy, sz), sx slowest."""
    b, c, x_, y_, z_ = x.shape
    s = scale_factor
    if c % (s ** 3):
        raise ValueError(f"pixel_shuffle_3d: {c} channels are not divisible by scale_factor^3 = {s ** 3}")
    c_out = c // s ** 3
    x = x.reshape(b, c_out, s, s, s, x_, y_, z_)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, c_out, x_ * s, y_ * s, z_ * s)


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, C, *spatial] -> [B, C*p^D, *spatial/p] with the channel index decomposed as (C, p_1, ..., p_D)."""
    dims = x.dim() - 2
    for d in range(2, dims + 2):
        if x.shape[d] % patch_size:
            raise ValueError(f"patchify: dimension {d} of size {x.shape[d]} is not divisible by {patch_size}")
    b, c = x.shape[:2]
    shape = [b, c]
    for d in range(2, dims + 2):
        shape += [x.shape[d] // patch_size, patch_size]
    x = x.reshape(*shape)
    order = [0, 1] + [3 + 2 * i for i in range(dims)] + [2 + 2 * i for i in range(dims)]
    x = x.permute(*order)
    return x.reshape(b, c * patch_size ** dims, *[x.shape[2 + dims + i] for i in range(dims)])


def unpatchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Inverse of `patchify`."""
    dims = x.dim() - 2
    b, c = x.shape[:2]
    c_out = c // patch_size ** dims
    x = x.reshape(b, c_out, *[patch_size] * dims, *x.shape[2:])
    order = [0, 1] + sum([[2 + dims + i, 2 + i] for i in range(dims)], [])
    x = x.permute(*order)
    return x.reshape(b, c_out, *[x.shape[2 + 2 * i] * patch_size for i in range(dims)])
