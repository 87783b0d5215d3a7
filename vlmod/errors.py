"""Errors shared across vlmod, and `brief`, how a message echoes a bad value; imported by everything,
importing nothing of vlmod."""

from __future__ import annotations

import reprlib
from typing import Any

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 6
_BRIEF.maxlevel = 2


def brief(value: Any) -> str:
    """`repr(value)` for an error message, bounded: a value read from a config file can be huge (a
    YAML alias bomb is billions of items), and a message must stay one short line. Small values
    read exactly as `repr` gives them."""
    text = _BRIEF.repr(value)  # reprlib stops early: never the whole value
    return text if len(text) <= 100 else text[:97] + "..."


class InputError(ValueError):
    """The user asked for something that cannot run (unknown model, capacity outside (0, 1], a
    layer out of range, a path that cannot be written). The CLI reports it as one `error:` line;
    a ValueError from deeper down is a bug and keeps its traceback."""



class TrainError(InputError):
    """A fine-tuning run was asked for something that cannot run (a missing file, a bad config
    key, a model that is not LLaVA). The command reports it as one `error:` line."""


__all__ = ["InputError", "TrainError", "brief"]
