from .cube2mesh import MeshExtractResult, SparseFeatures2Mesh

__all__ = ["MeshExtractResult", "SparseFeatures2Mesh"]
