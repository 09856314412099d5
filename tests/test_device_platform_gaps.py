"""The publicly reported device gaps the project works around, each checked on every test device: the raw PyTorch
op (a strict xfail on the device where the report says it is wrong, with the PyTorch issue) next to the project's
workaround, which must be right everywhere. On the CPU and CUDA both halves pass; on an MPS machine the raw halves
must fail as reported (a strict xfail turns into a failure the day PyTorch fixes them: then the mark, and maybe the
workaround, can go). Sources: ../shared/docs/PLATFORMS.md and README "MPS workarounds and the PyTorch issue each
guards"."""
import platform

import pytest
import torch
import torch.nn.functional as F

import backends
from conftest import assert_close_to_reference


def _torch_at_most(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) <= (major, minor)


def _macos_at_least(major: int, minor: int) -> bool:
    version = platform.mac_ver()[0]
    if not version:
        return False
    parts = [int(p) for p in version.split(".")[:2]] + [0]
    return (parts[0], parts[1]) >= (major, minor)


CHANNELS = [(1, 1), (3, 5), (8, 8), (16, 32), (33, 7)]  # "wrong values for most channel counts"


def _conv3d_case(cin, cout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cin, 6, 5, 7, generator=g)
    w = torch.randn(cout, cin, 3, 3, 3, generator=g) / (27 * cin) ** 0.5
    b = torch.randn(cout, generator=g)
    return x, w, b, F.conv3d(x.double(), w.double(), b.double(), padding=1)


@pytest.mark.device_xfail("mps", reason="Conv3d returns incorrect values on MPS (pytorch#197114)")
def test_raw_conv3d(device, exact_float32):
    for cin, cout in CHANNELS:
        x, w, b, ref = _conv3d_case(cin, cout)
        assert_close_to_reference(F.conv3d(x.to(device), w.to(device), b.to(device), padding=1), ref)


def test_dense_conv3d_workaround(device, exact_float32):
    """backends.dense_conv3d (batched Conv2d per kernel-depth offset on MPS) is right on every device."""
    for cin, cout in CHANNELS:
        x, w, b, ref = _conv3d_case(cin, cout)
        assert_close_to_reference(backends.dense_conv3d(x.to(device), w.to(device), b.to(device), (1, 1, 1)), ref)


@pytest.mark.device_xfail("mps", condition=_torch_at_most(2, 13),
                          reason="F.conv2d ignores the strides of a non-contiguous weight on MPS (pytorch#192212, "
                                 "fixed after 2.13)")
def test_raw_conv2d_with_a_non_contiguous_weight(device, exact_float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 9, 8, generator=g)
    w5 = torch.randn(4, 6, 3, 3, 3, generator=g)
    w = w5.to(device)[:, :, 1]  # a slice of a 5-D kernel: non-contiguous
    assert not w.is_contiguous()
    ref = F.conv2d(x.double(), w5[:, :, 1].double(), padding=1)
    assert_close_to_reference(F.conv2d(x.to(device), w, padding=1), ref)


@pytest.mark.device_xfail("mps", condition=_torch_at_most(2, 13),
                          reason="F.linear with a bias on a >2-D input whose size(-3) exceeds 65,536 writes wrong "
                                 "rows on MPS (pytorch#189495, fixed by PR 189496 after 2.13)")
def test_raw_linear_with_bias_on_a_long_third_to_last_dim(device, exact_float32):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(65_537 + 3, 2, 4, generator=g)
    w, b = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    ref = F.linear(x.double(), w.double(), b.double())
    assert_close_to_reference(F.linear(x.to(device), w.to(device), b.to(device)), ref)


@pytest.mark.device_xfail("mps", condition=_macos_at_least(15, 4),
                          reason="int64 sort / argsort return garbage beyond 256 elements on MPS on macOS >= 15.4 "
                                 "(pytorch#155560)")
def test_raw_int64_sort_beyond_256_elements(device):
    g = torch.Generator().manual_seed(3)
    keys = torch.randint(-2 ** 40, 2 ** 40, (5000,), generator=g, dtype=torch.int64)
    values, order = torch.sort(keys.to(device))
    assert torch.equal(values.cpu(), torch.tensor(sorted(keys.tolist())))
    assert torch.equal(keys[order.cpu()], values.cpu())


@pytest.mark.device_xfail("mps", reason="sort / argsort ignore the strides of non-contiguous inputs on MPS "
                                        "(pytorch#175187)")
def test_raw_sort_of_a_non_contiguous_input(device):
    g = torch.Generator().manual_seed(4)
    table = torch.randint(0, 1000, (700, 3), generator=g, dtype=torch.int32)
    column = table.to(device)[:, 1]  # strided view
    assert not column.is_contiguous()
    values, _ = torch.sort(column)
    assert torch.equal(values.cpu(), torch.tensor(sorted(table[:, 1].tolist()), dtype=torch.int32))


def test_backends_sort_and_unique_workarounds(device):
    """backends.sort / argsort / unique (int32 keys where the range fits, a one-time check of the device sort,
    contiguous inputs) are right on every device, for int64 keys beyond int32 and for strided views."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randint(-2 ** 40, 2 ** 40, (5000,), generator=g, dtype=torch.int64)
    narrow = torch.randint(0, 300, (3000,), generator=g, dtype=torch.int64)
    table = torch.randint(0, 1000, (700, 3), generator=g, dtype=torch.int32)
    for keys in (wide.to(device), narrow.to(device), table.to(device)[:, 1]):
        want = sorted(keys.cpu().tolist())
        values, order = backends.sort(keys)
        assert values.device.type == device.type and values.dtype == keys.dtype
        assert values.cpu().tolist() == want and keys.cpu()[order.cpu()].tolist() == want
        assert backends.argsort(keys).cpu().tolist() == order.cpu().tolist() or \
            keys.cpu()[backends.argsort(keys).cpu()].tolist() == want
        assert backends.unique(keys).cpu().tolist() == sorted(set(want))
