"""Small helpers referenced by the released configs (``_target_: sam3d_objects.config.utils.make_dict``)."""
from __future__ import annotations

from typing import Any, Dict


def make_dict(**kwargs: Any) -> Dict[str, Any]:
    """Build a plain dict from the node's keys (hydra would otherwise pass a DictConfig)."""
    return dict(kwargs)
