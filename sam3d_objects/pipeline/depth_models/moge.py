"""MoGe depth model adapter: RGB image -> point map in the PyTorch3D camera frame (x left, y up, z forward)."""
from __future__ import annotations

from typing import Any, Dict, Union

import numpy as np
import torch

import backends


class MoGe:
    """Wraps ``moge.model.v1.MoGeModel`` (package ``moge``; weights ``Ruicheng/moge-vitl``).

    ``model`` is the MoGe network, or its (not yet instantiated) hydra config: then the network is built on first
    use, so constructing the pipeline never downloads anything and a caller-provided ``pointmap`` never needs
    MoGe at all. Works on any device (``device`` None = the backends default).
    """

    def __init__(self, model: Any, device: Union[str, torch.device, None] = None, force_projection: bool = False):
        self._model = model
        self.device_given = device is not None  # otherwise the pipeline hands over its own device
        self.device = backends.device.as_device(device)
        self.force_projection = force_projection

    @property
    def model(self) -> torch.nn.Module:
        if not isinstance(self._model, torch.nn.Module):
            from sam3d_objects.config.instantiate import safe_instantiate, trusted_import
            try:
                trusted_import("moge")  # never a moge/ folder of a checkpoint folder
                self._model = safe_instantiate(self._model)
            except ImportError as e:
                raise ImportError(f"the depth model needs the `moge` package: `make extras EXTRAS=moge` in the clone (or "
                                  f"pip install --no-deps dlr-moge==2.0.0 dlr-utils3d==1.3 and pip install "
                                  f"opencv-python-headless scipy huggingface_hub) ({e}); or pass pointmap= "
                                  f"to Inference/run to skip the depth model") from e
            except ValueError:  # a refused config (sam3d_objects.config.safety) keeps its own message
                raise
            except Exception as e:  # noqa: BLE001  weights not downloadable (offline), corrupt cache, ...
                cause = e.__cause__ or e
                first = str(cause).splitlines()[0] if str(cause) else ""
                raise ImportError(f"the depth model (MoGe) could not be loaded ({type(cause).__name__}: "
                                  f"{first[:200]}); its weights come from Hugging Face on first use, or pass "
                                  f"pointmap= to Inference/run to skip the depth model") from e
        self._model = self._model.to(self.device).eval()
        return self._model

    @torch.no_grad()
    def __call__(self, image: np.ndarray) -> Dict[str, torch.Tensor]:
        """image: uint8 [H, W, 3] -> {"pointmap": [H, W, 3] float32 on CPU, NaN where invalid, "intrinsics"}."""
        rgb = torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1).float().div(255.0)
        out = self.model.infer(rgb.to(self.device), force_projection=self.force_projection)
        points = out["points"].float()
        mask = out.get("mask")
        if mask is not None:
            points = torch.where(mask.bool()[..., None], points, torch.full_like(points, float("nan")))
        points = points * torch.tensor([-1.0, -1.0, 1.0], device=points.device)  # OpenCV -> PyTorch3D frame
        result = {"pointmap": points.cpu()}
        if "intrinsics" in out:
            result["intrinsics"] = out["intrinsics"].float().cpu()
        return result
