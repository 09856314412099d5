from .gaussian_model import Gaussian

__all__ = ["Gaussian"]
