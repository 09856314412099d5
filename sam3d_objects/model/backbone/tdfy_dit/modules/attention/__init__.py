"""Dense attention: `scaled_dot_product_attention` (through `backends.attention`) and attention layers."""
from .full_attn import scaled_dot_product_attention
from .modules import MultiHeadAttention, MultiHeadRMSNorm, RotaryPositionEmbedder

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention", "MultiHeadRMSNorm", "RotaryPositionEmbedder"]

# ---- upstream's module-level switches, mirrored from / delegated to `backends` (whose registry reads the env)
import logging as _logging  # noqa: E402

import backends as _backends  # noqa: E402

logger = _logging.getLogger("sam3d_objects.attention")
BACKEND: str = _backends.requested_backend("attn")
DEBUG: bool = _backends.env_flag("ATTN_DEBUG")


def set_backend(backend: str) -> None:
    """Choose the dense attention backend process-wide (``backends.set_backend(attn=...)``)."""
    global BACKEND
    import backends
    backends.set_backend(attn=backend)
    BACKEND = backend


def set_debug(debug: bool) -> None:
    global DEBUG
    DEBUG = bool(debug)
