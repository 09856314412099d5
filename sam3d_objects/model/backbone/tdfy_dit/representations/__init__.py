"""Output representations of the structured-latent decoders."""
from .gaussian import Gaussian
from .mesh import MeshExtractResult, SparseFeatures2Mesh

__all__ = ["Gaussian", "MeshExtractResult", "SparseFeatures2Mesh"]
