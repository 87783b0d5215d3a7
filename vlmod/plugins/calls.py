"""Reading and replacing one argument of an upstream block call, passed by position or by name."""

from __future__ import annotations

import inspect
from typing import Any


class ArgSlot:
    """Where argument `name` of `fn` sits in a call: its position (after self) or its keyword."""

    def __init__(self, fn: Any, name: str):
        params = [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        self.name = name
        self.pos = params.index(name) if name in params else None

    def get(self, args: tuple | list, kwargs: dict) -> Any:
        if self.pos is not None and len(args) > self.pos:
            return args[self.pos]
        return kwargs.get(self.name)

    def set(self, args: list, kwargs: dict, value: Any) -> None:
        """Replace the argument in place in `args` (a list) or `kwargs`."""
        if self.pos is not None and len(args) > self.pos:
            args[self.pos] = value
        else:
            kwargs[self.name] = value
