"""The installed torchsparse package as a sparse-conv backend (``SPARSE_BACKEND=torchsparse``, CUDA)."""
from __future__ import annotations

import torch

from ..registry import Family, register
from .portable import torch_sparse_conv3d


_TORCHSPARSE_ORDER: dict = {}


def _torchsparse_run(feats, coords, weight, order):
    import torchsparse
    import torchsparse.nn.functional as TF

    k = weight.shape[1]
    perm = (1, 2, 3) if order == "xyz" else (3, 2, 1)
    w = weight.permute(*perm, 4, 0).reshape(k ** 3, weight.shape[4], weight.shape[0]).contiguous()
    x = torchsparse.SparseTensor(feats.contiguous(), coords.to(torch.int32).contiguous())
    return TF.conv3d(x, w, kernel_size=(k, k, k), bias=None, stride=1).feats


def _torchsparse_offset_order(device, dtype) -> str:
    """torchsparse's kernel-offset order has changed between releases; find it once by comparing a tiny random
    convolution with the portable implementation, and refuse to run if neither order matches."""
    if "order" not in _TORCHSPARSE_ORDER:
        g = torch.Generator(device="cpu").manual_seed(0)
        coords = torch.unique(torch.randint(0, 5, (60, 3), generator=g), dim=0)
        coords = torch.cat([torch.zeros_like(coords[:, :1]), coords], 1).to(device=device, dtype=torch.int32)
        feats = torch.randn(coords.shape[0], 4, generator=g).to(device, dtype)
        weight = torch.randn(3, 3, 3, 3, 4, generator=g).to(device, dtype)
        want = torch_sparse_conv3d(feats, coords, weight)
        for order in ("xyz", "zyx"):
            if torch.allclose(_torchsparse_run(feats, coords, weight, order), want, atol=1e-2, rtol=1e-2):
                _TORCHSPARSE_ORDER["order"] = order
                break
        else:
            raise RuntimeError("the installed torchsparse gives results that match neither kernel-offset order; "
                               "use SPARSE_BACKEND=torch")
    return _TORCHSPARSE_ORDER["order"]


@register(Family.SPARSE_CONV, "torchsparse", devices=("cuda",), dtypes=(torch.float32, torch.float16),
          requires=("torchsparse",), priority=10)
def torchsparse_sparse_conv3d(feats, coords, weight, bias=None, nmap=None):
    """torchsparse (2.1+, coords as b/x/y/z) adapter; its offset order is checked once against ours."""
    out = _torchsparse_run(feats, coords, weight, _torchsparse_offset_order(feats.device, feats.dtype))
    return out + bias if bias is not None else out
