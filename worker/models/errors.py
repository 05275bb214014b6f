"""Errors raised while finding or loading a model."""

from __future__ import annotations

from tokenfleet.shared.errors import SettingsError

EXIT_MODEL_UNAVAILABLE = 4  # the worker's exit status when its model cannot be loaded


class ModelFileError(SettingsError):
    """The model named cannot be found or read: a missing, truncated or non-model file, an
    unknown short name, a hub id that is not in the local cache. The message names the file or
    name and the fix."""
