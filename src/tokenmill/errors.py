"""Exceptions that tokenmill raises on bad input: each one names the problem in its message."""


class TokenmillError(Exception):
    """Base class for every error tokenmill raises on purpose."""


class ModelLoadError(TokenmillError):
    """A model could not be found, parsed or loaded; the message names the file and what is wrong."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no implementation in tokenmill."""


class TokenizerError(TokenmillError):
    """A tokenizer could not be loaded or cannot do what was asked (e.g. a chat without a template)."""
