"""Errors shared across vlmod; imported by everything, importing nothing of vlmod."""

from __future__ import annotations


class InputError(ValueError):
    """The user asked for something that cannot run (unknown model, capacity outside (0, 1], a
    layer out of range, a path that cannot be written). The CLI reports it as one `error:` line;
    a ValueError from deeper down is a bug and keeps its traceback."""


__all__ = ["InputError"]
