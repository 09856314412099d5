"""3D Gaussian splat set produced by the Gaussian decoder (upstream attribute names, activations and PLY layout)."""
from typing import List, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from .general_utils import build_scaling_rotation, inverse_sigmoid, strip_symmetric

__all__ = ["Gaussian"]


def softplus_inverse(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def softplus_inverse_scaling_activation(x: torch.Tensor) -> torch.Tensor:
    """Inverse of softplus, log(exp(x) - 1) in a stable form (upstream's name)."""
    return softplus_inverse(x)


class Gaussian:
    """Gaussians stored raw (``_xyz`` in [0, 1] aabb units, ``_features_dc``, ``_scaling``, ``_rotation``,
    ``_opacity``) with constant biases; the ``get_*`` properties apply the activations:

    * get_xyz = _xyz * aabb[3:] + aabb[:3]
    * get_scaling = sqrt(act(_scaling + scale_bias)^2 + mininum_kernel_size^2), scale_bias = act^-1(scaling_bias)
    * get_rotation = normalize(_rotation + [1, 0, 0, 0])
    * get_opacity = sigmoid(_opacity + logit(opacity_bias))

    Everything lives on ``device`` (default: CPU; upstream defaulted to CUDA).
    """

    def __init__(self, aabb: Sequence[float], sh_degree: int = 0, mininum_kernel_size: float = 0.0,
                 scaling_bias: float = 0.01, opacity_bias: float = 0.1, scaling_activation: str = "exp",
                 device: Union[str, torch.device] = "cpu"):
        self.init_params = {"aabb": aabb, "sh_degree": sh_degree, "mininum_kernel_size": mininum_kernel_size,
                            "scaling_bias": scaling_bias, "opacity_bias": opacity_bias,
                            "scaling_activation": scaling_activation}
        self.sh_degree = sh_degree
        self.active_sh_degree = sh_degree
        self.mininum_kernel_size = mininum_kernel_size
        self.scaling_bias = scaling_bias
        self.opacity_bias = opacity_bias
        self.scaling_activation_type = scaling_activation
        self.device = torch.device(device)
        self.aabb = torch.tensor(aabb, dtype=torch.float32, device=self.device)
        self.setup_functions()
        self._xyz: Optional[torch.Tensor] = None
        self._features_dc: Optional[torch.Tensor] = None
        self._features_rest: Optional[torch.Tensor] = None
        self._scaling: Optional[torch.Tensor] = None
        self._rotation: Optional[torch.Tensor] = None
        self._opacity: Optional[torch.Tensor] = None

    def setup_functions(self) -> None:
        if self.scaling_activation_type == "exp":
            self.scaling_activation = torch.exp
            self.inverse_scaling_activation = torch.log
        elif self.scaling_activation_type == "softplus":
            self.scaling_activation = F.softplus
            self.inverse_scaling_activation = softplus_inverse_scaling_activation
        else:
            raise ValueError(f"scaling_activation must be 'exp' or 'softplus', got {self.scaling_activation_type!r}")
        self.opacity_activation = torch.sigmoid
        self.inverse_opacity_activation = inverse_sigmoid
        self.rotation_activation = F.normalize
        self.scale_bias = self.inverse_scaling_activation(torch.tensor(self.scaling_bias)).to(self.device)
        self.rots_bias = torch.tensor([1.0, 0.0, 0.0, 0.0], device=self.device)
        self.opacity_bias = self.inverse_opacity_activation(torch.tensor(self.opacity_bias)).to(self.device)

    def covariance_activation(self, scaling: torch.Tensor, scaling_modifier: float,
                              rotation: torch.Tensor) -> torch.Tensor:
        return Gaussian.build_covariance_from_scaling_rotation(scaling, scaling_modifier, rotation)

    @staticmethod
    def build_covariance_from_scaling_rotation(scaling: torch.Tensor, scaling_modifier: float,
                                               rotation: torch.Tensor) -> torch.Tensor:
        """Upper-triangle 6-vectors of the covariances (R S)(R S)^T for scales * modifier and quaternions."""
        L = build_scaling_rotation(scaling_modifier * scaling, rotation)
        return strip_symmetric(L @ L.transpose(1, 2))

    # -------------------------------------------------------------------------------------------------- getters
    @property
    def get_scaling(self) -> torch.Tensor:
        scales = self.scaling_activation(self._scaling + self.scale_bias)
        return torch.sqrt(torch.square(scales) + self.mininum_kernel_size ** 2)

    @property
    def get_rotation(self) -> torch.Tensor:
        return self.rotation_activation(self._rotation + self.rots_bias[None, :])

    @property
    def get_xyz(self) -> torch.Tensor:
        return self._xyz * self.aabb[None, 3:] + self.aabb[None, :3]

    @property
    def get_features(self) -> torch.Tensor:
        if self._features_rest is not None:
            return torch.cat((self._features_dc, self._features_rest), dim=2)
        return self._features_dc

    @property
    def get_opacity(self) -> torch.Tensor:
        return self.opacity_activation(self._opacity + self.opacity_bias)

    def get_covariance(self, scaling_modifier: float = 1) -> torch.Tensor:
        return self.covariance_activation(self.get_scaling, scaling_modifier, self._rotation + self.rots_bias[None, :])

    # ------------------------------------------------------------------------------------------------- setters
    def from_scaling(self, scales: torch.Tensor) -> None:
        scales = torch.sqrt(torch.clamp(torch.square(scales) - self.mininum_kernel_size ** 2, min=0))
        self._scaling = self.inverse_scaling_activation(scales) - self.scale_bias

    def from_rotation(self, rots: torch.Tensor) -> None:
        self._rotation = rots - self.rots_bias[None, :]

    def from_xyz(self, xyz: torch.Tensor) -> None:
        self._xyz = (xyz - self.aabb[None, :3]) / self.aabb[None, 3:]

    def from_features(self, features: torch.Tensor) -> None:
        self._features_dc = features

    def from_opacity(self, opacities: torch.Tensor) -> None:
        self._opacity = self.inverse_opacity_activation(opacities) - self.opacity_bias

    # ------------------------------------------------------------------------------------------------------ io
    def construct_list_of_attributes(self) -> List[str]:
        names = ["x", "y", "z", "nx", "ny", "nz"]
        names += [f"f_dc_{i}" for i in range(self._features_dc.shape[1] * self._features_dc.shape[2])]
        names.append("opacity")
        names += [f"scale_{i}" for i in range(self._scaling.shape[1])]
        names += [f"rot_{i}" for i in range(self._rotation.shape[1])]
        return names

    def ply_attributes(self) -> np.ndarray:
        """[N, 17] float32 rows as save_ply writes them: xyz, zero normals, dc colour, logit opacity,
        log scale, un-normalised rotation (+ bias)."""
        xyz = self.get_xyz.detach().float().cpu().numpy()
        normals = np.zeros_like(xyz)
        f_dc = self._features_dc.detach().transpose(1, 2).flatten(start_dim=1).contiguous().float().cpu().numpy()
        opacities = inverse_sigmoid(self.get_opacity).detach().float().cpu().numpy()
        scale = torch.log(self.get_scaling).detach().float().cpu().numpy()
        rotation = (self._rotation + self.rots_bias[None, :]).detach().float().cpu().numpy()
        return np.concatenate((xyz, normals, f_dc, opacities, scale, rotation), axis=1).astype(np.float32)

    def save_ply(self, path: str) -> None:
        """Binary little-endian PLY with one float32 'vertex' element (the layout 3DGS viewers read)."""
        from plyfile import PlyData, PlyElement

        attributes = self.ply_attributes()
        dtype_full = [(name, "f4") for name in self.construct_list_of_attributes()]
        elements = np.empty(attributes.shape[0], dtype=dtype_full)
        for i, (name, _) in enumerate(dtype_full):
            elements[name] = attributes[:, i]
        PlyData([PlyElement.describe(elements, "vertex")]).write(path)

    def load_ply(self, path: str) -> None:
        """Read a PLY written by save_ply (positions, DC colours, opacities, scales, rotations) into this object."""
        from plyfile import PlyData

        vertex = PlyData.read(path)["vertex"]
        names = vertex.data.dtype.names

        def columns(prefix: str) -> np.ndarray:
            picked = sorted((n for n in names if n.startswith(prefix)), key=lambda n: int(n.split("_")[-1]))
            return np.stack([np.asarray(vertex[n]) for n in picked], axis=1)

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.ascontiguousarray(array), dtype=torch.float32, device=self.device)

        xyz = np.stack([np.asarray(vertex[a]) for a in ("x", "y", "z")], axis=1)
        f_dc = columns("f_dc_").reshape(-1, 3, 1).transpose(0, 2, 1)
        self.from_xyz(tensor(xyz))
        self._features_dc = tensor(f_dc)
        self._features_rest = None
        self.from_opacity(torch.sigmoid(tensor(np.asarray(vertex["opacity"])[:, None])))
        self.from_scaling(torch.exp(tensor(columns("scale_"))))
        self.from_rotation(tensor(columns("rot_")))
