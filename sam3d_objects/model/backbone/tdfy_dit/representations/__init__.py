"""Output representations of the structured-latent decoders."""
from .gaussian import Gaussian
from .mesh import MeshExtractResult, SparseFeatures2Mesh
from .octree import DfsOctree as Octree
from .radiance_field import Strivec

__all__ = ["Gaussian", "MeshExtractResult", "SparseFeatures2Mesh", "Octree", "Strivec"]
