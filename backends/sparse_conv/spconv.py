"""The installed spconv package as a sparse-conv backend (``SPARSE_BACKEND=spconv``; auto-picked on CUDA)."""
from __future__ import annotations

from typing import Optional

import torch

from ..registry import Family, register
from .portable import _map_for


def _spconv_probe(device: torch.device) -> Optional[str]:
    if device.type == "cpu":
        # spconv's CPU kernels race with more than one OpenMP thread: some output rows come out wrong, silently
        # (observed with spconv 2.x CPU builds; one thread gives the exact rows).
        if torch.get_num_threads() != 1:
            return (f"spconv on CPU is only correct with one thread (torch has {torch.get_num_threads()}); "
                    "call torch.set_num_threads(1) and set OMP_NUM_THREADS=1, or use 'torch'")
    return None


@register(Family.SPARSE_CONV, "spconv", devices=("cpu", "cuda"), dtypes=(torch.float32, torch.float16),
          requires=("spconv",), probe=_spconv_probe, priority=20, auto_devices=("cuda",),
          volatile=True)
def spconv_sparse_conv3d(feats, coords, weight, bias=None, nmap=None):
    """The installed spconv package, same weight layout. spconv's own index pairs are built on the first call for
    a coordinate set and kept with our neighbour map, so layers at the same coordinates reuse them."""
    import spconv.pytorch as spconv

    k = weight.shape[1]
    template = _map_for(coords, k, nmap).extra(("spconv", k), lambda _: _spconv_template(feats, coords, k))
    key = (weight.shape[4], weight.shape[0], k, weight.device, weight.dtype)
    if key not in _SPCONV_MODULES:
        # Building (and randomly initialising) a module per call costs milliseconds; one per shape is kept and
        # pointed at the caller's weight each time.
        conv = spconv.SubMConv3d(key[0], key[1], k, bias=False, indice_key=_SPCONV_KEY).to(key[3], key[4])
        _SPCONV_MODULES[key] = conv.requires_grad_(False)
    conv = _SPCONV_MODULES[key]
    conv.weight.data = weight.detach()  # an inference adapter: no gradients flow through it
    result = conv(template.replace_feature(feats.contiguous()))
    if _SPCONV_KEY not in template.indice_dict:
        # spconv files the pairs it built in its output's index dictionary, not in the input's: without this
        # every call would build them again (a sort per layer per call, which also breaks CUDA-graph capture)
        template.indice_dict.update(result.indice_dict)
    out = result.features
    return out + bias if bias is not None else out


_SPCONV_KEY = "sam3d_subm"
_SPCONV_MODULES: dict = {}


def _spconv_template(feats, coords, k):
    """A SparseConvTensor whose index dictionary is shared by every ``replace_feature`` copy."""
    import spconv.pytorch as spconv

    c = coords.to(torch.int32).contiguous()
    shape = (c[:, 1:].max(dim=0).values + k).tolist()
    return spconv.SparseConvTensor(feats.contiguous(), c, shape, int(c[:, 0].max()) + 1)
