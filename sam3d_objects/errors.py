"""The command line's exit codes and the error every front end (``cli``, ``segment``, ``batch``, the web app, the
demo) raises for a problem the user can fix. A module of its own, below all of them, so that none has to import
the CLI for it (``sam3d_objects.cli`` re-exports these names). The errors and the warning the checks of
``sam3d_objects.validation`` raise live here too (re-exported there), so that the config and image readers
below the validation module can raise them without importing it."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, Path]

EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_CHECKPOINT, EXIT_RUN, EXIT_INTERRUPT = 0, 1, 2, 3, 4, 130

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_INPUT", "EXIT_CHECKPOINT", "EXIT_RUN", "EXIT_INTERRUPT", "UserError",
           "DeviceUnavailableError", "ConfigError", "InputWarning"]


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it (exit code ``code``)."""

    def __init__(self, message: str, code: int = EXIT_INPUT):
        super().__init__(message)
        self.code = code


class DeviceUnavailableError(RuntimeError):
    """The requested torch device does not exist on this machine / torch build."""


class ConfigError(ValueError):
    """A yaml of the checkpoint folder cannot be used (syntax, allow-list, unknown target, missing key)."""

    def __init__(self, yaml: PathLike, key: str, target: Optional[str], reason: str):
        where = f"{yaml}: {key}" + (f" (_target_: {target})" if target else "")
        super().__init__(f"{where}: {reason}")
        self.yaml, self.key, self.target, self.reason = str(yaml), key, target, reason


class InputWarning(UserWarning):
    """Input that works but is likely to give a poor or slow result."""
