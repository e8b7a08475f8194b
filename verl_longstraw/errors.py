"""Errors raised by verl-longstraw. Each message names the offending field and the fix."""


class UnsupportedModelError(ValueError):
    """The model type, or a feature of a supported model type, has no replay adapter."""
