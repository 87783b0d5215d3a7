"""Errors shared across vlmod; imported by everything, importing nothing of vlmod."""

from __future__ import annotations


class InputError(ValueError):
    """The user asked for something that cannot run (unknown model, capacity outside (0, 1], a
    layer out of range, a path that cannot be written). The CLI reports it as one `error:` line;
    a ValueError from deeper down is a bug and keeps its traceback."""



class TrainError(InputError):
    """A fine-tuning run was asked for something that cannot run (a missing file, a bad config
    key, a model that is not LLaVA). The command reports it as one `error:` line."""


__all__ = ["InputError", "TrainError"]
