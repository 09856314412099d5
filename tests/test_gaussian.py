"""Gaussian representation: activations against closed-form float64 formulas, covariance against R S S^T R^T,
save_ply layout (header bytes and values read back with plyfile)."""
import numpy as np
import torch
from plyfile import PlyData

from conftest import host
from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian import Gaussian

HEADER = ("ply\nformat binary_little_endian 1.0\nelement vertex {n}\n"
          + "".join(f"property float {p}\n" for p in ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2",
                                                       "opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1",
                                                       "rot_2", "rot_3"])
          + "end_header\n")


def make_gaussian(n=20, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gs = Gaussian(aabb=[-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], mininum_kernel_size=0.0009, scaling_bias=0.004,
                  opacity_bias=0.1, scaling_activation="softplus", device=device)
    gs._xyz = torch.rand(n, 3, generator=g).to(device)
    gs._features_dc = torch.randn(n, 1, 3, generator=g).to(device)
    gs._scaling = torch.randn(n, 3, generator=g).to(device)
    gs._rotation = (torch.randn(n, 4, generator=g) * 0.3).to(device)
    gs._opacity = torch.randn(n, 1, generator=g).to(device)
    return gs


class Host:
    """The gaussians' raw fields and activated getters, read once on the device and brought to the host."""

    def __init__(self, gs):
        for name in ("_xyz", "_features_dc", "_scaling", "_rotation", "_opacity", "get_xyz", "get_scaling",
                     "get_opacity", "get_rotation", "rots_bias"):
            setattr(self, name, host(getattr(gs, name)))
        self.covariance = host(gs.get_covariance())


def test_activations_match_formulas(device):
    gs = make_gaussian(device=device)
    assert gs.get_scaling.device.type == device.type and gs.get_features is gs._features_dc
    gs = Host(gs)
    s = gs._scaling.double()
    bias = np.log(np.expm1(0.004))  # softplus^-1(0.004)
    scale = torch.sqrt(torch.nn.functional.softplus(s + bias) ** 2 + 0.0009 ** 2)
    torch.testing.assert_close(gs.get_scaling.double(), scale, rtol=1e-5, atol=1e-7)
    opacity = torch.sigmoid(gs._opacity.double() + np.log(0.1 / 0.9))
    torch.testing.assert_close(gs.get_opacity.double(), opacity, rtol=1e-5, atol=1e-7)
    q = gs._rotation.double() + torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(gs.get_rotation.double(), q / q.norm(dim=1, keepdim=True), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gs.get_xyz, gs._xyz - 0.5)


def quaternion_matrix(q: np.ndarray) -> np.ndarray:
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def test_covariance(device):
    gs = Host(make_gaussian(device=device))
    cov = gs.covariance.double().numpy()
    scales = gs.get_scaling.double().numpy()
    rots = (gs._rotation + gs.rots_bias).double().numpy()
    for i in range(cov.shape[0]):
        r = quaternion_matrix(rots[i])
        full = r @ np.diag(scales[i] ** 2) @ r.T
        np.testing.assert_allclose(cov[i], full[np.triu_indices(3)], rtol=1e-4, atol=1e-9)
        # rotation is a proper rotation
        np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-12)


def test_save_ply_layout(tmp_path, device):
    path = tmp_path / "g.ply"
    make_gaussian(n=7, device=device).save_ply(str(path))  # written from the device's tensors
    gs = Host(make_gaussian(n=7))
    data = path.read_bytes()
    header = HEADER.format(n=7).encode()
    assert data[:len(header)] == header and len(data) == len(header) + 7 * 17 * 4
    v = PlyData.read(str(path))["vertex"]
    np.testing.assert_allclose(np.stack([v["x"], v["y"], v["z"]], 1), gs.get_xyz.numpy(), rtol=1e-6)
    np.testing.assert_allclose(v["opacity"], torch.logit(gs.get_opacity.double()).numpy()[:, 0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.stack([v[f"scale_{i}"] for i in range(3)], 1), np.log(gs.get_scaling.numpy()),
                               rtol=1e-6)
    raw_rot = (gs._rotation + torch.tensor([1.0, 0, 0, 0])).numpy()  # stored un-normalised
    np.testing.assert_allclose(np.stack([v[f"rot_{i}"] for i in range(4)], 1), raw_rot, rtol=1e-6)
    assert np.all(np.stack([v["nx"], v["ny"], v["nz"]]) == 0)
