"""Gaussian-splat maths: inverse sigmoid, quaternion -> rotation, covariance upper triangles."""
import torch

__all__ = ["inverse_sigmoid", "build_rotation", "build_scaling_rotation", "strip_lowerdiag", "strip_symmetric"]


def inverse_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x / (1 - x))


def build_rotation(r: torch.Tensor) -> torch.Tensor:
    """[N, 4] quaternions (w, x, y, z), normalised here -> [N, 3, 3] rotation matrices."""
    q = r / torch.linalg.vector_norm(r, dim=1, keepdim=True)
    w, x, y, z = q.unbind(dim=1)
    rows = [
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ]
    return torch.stack(rows, dim=1).reshape(-1, 3, 3)


def build_scaling_rotation(s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """L = R(r) @ diag(s), [N, 3, 3]."""
    return build_rotation(r) * s[:, None, :]


def strip_lowerdiag(L: torch.Tensor) -> torch.Tensor:
    """Upper triangle (xx, xy, xz, yy, yz, zz) of [N, 3, 3] symmetric matrices -> [N, 6]."""
    return torch.stack([L[:, 0, 0], L[:, 0, 1], L[:, 0, 2], L[:, 1, 1], L[:, 1, 2], L[:, 2, 2]], dim=1)


def strip_symmetric(sym: torch.Tensor) -> torch.Tensor:
    return strip_lowerdiag(sym)


def PILtoTorch(pil_image, resolution) -> torch.Tensor:  # noqa: N802 (upstream's name)
    """PIL image resized to `resolution` (W, H) -> float tensor in [0, 1], channels first ((1, H, W) for grey)."""
    import numpy as np

    array = torch.from_numpy(np.array(pil_image.resize(resolution))) / 255.0
    if array.dim() == 3:
        return array.permute(2, 0, 1)
    return array.unsqueeze(dim=0)


def get_expon_lr_func(lr_init: float, lr_final: float, lr_delay_steps: int = 0, lr_delay_mult: float = 1.0,
                      max_steps: int = 1000000):
    """Learning-rate schedule of 3D Gaussian Splatting: log-linear decay from lr_init to lr_final over max_steps,
    eased in from lr_init * lr_delay_mult over lr_delay_steps."""
    import math

    def helper(step: int) -> float:
        if step < 0 or (lr_init == 0.0 and lr_final == 0.0):
            return 0.0
        if lr_delay_steps > 0:
            delay = lr_delay_mult + (1 - lr_delay_mult) * math.sin(0.5 * math.pi * min(max(step / lr_delay_steps,
                                                                                           0.0), 1.0))
        else:
            delay = 1.0
        t = min(max(step / max_steps, 0.0), 1.0)
        return delay * math.exp(math.log(lr_init) * (1 - t) + math.log(lr_final) * t)

    return helper


class F:
    """sys.stdout replacement installed by ``safe_state`` (upstream's name): a write ending a line gets the time
    stamp before each line end; nothing is written when ``silent``."""

    def __init__(self, silent: bool, stream=None):
        import sys
        self.silent = silent
        self.stream = sys.stdout if stream is None else stream

    def write(self, x: str) -> None:
        from datetime import datetime

        if self.silent:
            return
        if x.endswith("\n"):
            x = x.replace("\n", f" [{datetime.now().strftime('%d/%m %H:%M:%S')}]\n")
        self.stream.write(x)

    def flush(self) -> None:
        self.stream.flush()


_StampedWriter = F


def safe_state(silent: bool) -> None:
    """Training-script set-up: time-stamped (or silenced) stdout, and Python / NumPy / torch seeded with 0.
    Upstream then selects CUDA device 0; here the device stays the caller's choice."""
    import random
    import sys

    import numpy as np

    sys.stdout = F(silent, sys.stdout)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
