from .flexicubes import FlexiCubes

__all__ = ["FlexiCubes"]
