"""Strivec: an octree of tensorial (tri-vector, rank x 3 axes x dim) radiance-field voxels, the radiance-field
decoder's output representation."""
import math
from typing import Any, Optional, Sequence

from ..octree import DfsOctree as Octree


class Strivec(Octree):
    def __init__(self, resolution: int, aabb: Sequence[float], sh_degree: int = 0, rank: int = 8, dim: int = 8,
                 device: Optional[Any] = None):
        if math.log2(resolution) % 1 != 0:
            raise ValueError(f"Resolution must be a power of 2, got {resolution}")
        self.resolution = resolution
        super().__init__(depth=round(math.log2(resolution)), aabb=aabb, sh_degree=sh_degree, primitive="trivec",
                         primitive_config={"rank": rank, "dim": dim}, device=device)
