"""Upstream's ``sam3d_objects.utils.visualization``: scene plots (plotly, optional) and point-map meshes.

``SceneVisualizer`` and ``plot_tdfy_scene`` are imported on first use, so that importing this package needs
neither plotly nor PyTorch3D."""
from importlib import import_module

_EXPORTS = {"SceneVisualizer": ".scene_visualizer", "plot_tdfy_scene": ".plotly.plot_scene"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        try:
            module = import_module(_EXPORTS[name], __name__)
        except ModuleNotFoundError as e:  # surface as a missing attribute (hasattr-safe), naming the cause
            raise AttributeError(f"{name} is not available: {e}") from e
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
