"""What runs where: :func:`current` (one device) and :func:`report` (a table over every device present).

Kept out of the registry so that the registry needs no device helpers (it is the ground floor of ``backends``).
Model code never asks: this is for the CLI's backend report, ``python -m backends`` and tests.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .device import available_devices, default_device
from .registry import _ENUMS, _REGISTRY, BackendUnavailableError, Family, requested, resolve


def current(device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> dict[str, str]:
    """Which backend each family resolves to on ``device`` (default: the default device)."""
    device = torch.device(device) if device is not None else default_device()
    result = {}
    for family in Family:
        try:
            result[family.value] = resolve(family, device, dtype).name
        except (BackendUnavailableError, ValueError) as e:
            result[family.value] = f"error: {e}"
    return result


def report(devices: Optional[Sequence[torch.device | str]] = None) -> str:
    """A table of every backend per device: available or why not, and what auto picks."""
    devices = [torch.device(d) for d in (devices or available_devices())]
    lines = []
    for device in devices:
        lines.append(f"device {device.type}")
        for family in Family:
            name, source = requested(family)
            try:
                chosen = resolve(family, device).name
            except (BackendUnavailableError, ValueError) as e:
                chosen = f"ERROR ({e})"
            lines.append(f"  {family.value:<12} selected: {chosen}  [requested {name} via {source}]")
            for spec in sorted(_REGISTRY[family].values(), key=lambda s: -s.priority):
                reason = spec.why_not(device)
                state = "available" if reason is None else f"unavailable: {reason}"
                tag = " (reference)" if spec.reference else ""
                lines.append(f"    - {spec.name:<12}{tag} {state}")
            for member in _ENUMS[family]:
                if member.value != "auto" and member.value not in _REGISTRY[family]:
                    lines.append(f"    - {member.value:<12} unavailable: not implemented in this build")
    return "\n".join(lines)
