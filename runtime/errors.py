"""Errors a user can act on. The CLI prints their message without a traceback."""


class TallowError(Exception):
    """Base of every error whose message alone tells the user what is wrong."""


class ModelSourceError(TallowError):
    """The model to compile cannot be found or read (folder, hub id, GGUF file)."""


class ArtifactError(TallowError):
    """An artifact folder that is missing, damaged, or built for something else."""


class TargetError(TallowError):
    """A target or dtype the compiler or the device cannot handle."""
