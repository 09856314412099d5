"""The small scene records ``plot_scene`` draws and ``scene_visualizer`` builds (in place of PyTorch3D's point
clouds and cameras): here, below both, so that neither module imports the other."""
from collections import namedtuple

PointCloud = namedtuple("PointCloud", ["points", "features"])  # (1, N, 3) points, (1, N, 3) colours or None
CameraPose = namedtuple("CameraPose", ["R", "T"])  # (1, 3, 3), (1, 3): x_view = x_world @ R + T
