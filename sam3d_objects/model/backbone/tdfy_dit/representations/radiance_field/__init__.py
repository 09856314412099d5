from .strivec import Strivec

__all__ = ["Strivec"]
