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


# transformers 5.24 renamed the cache argument of every forward from `past_key_values` to `cache`
# (the old name still accepted, with a deprecation warning); both releases are supported.
CACHE_NAMES = ("cache", "past_key_values")


def _installed_cache_name() -> str:
    from importlib.metadata import version

    from packaging.version import Version

    return CACHE_NAMES[0] if Version(version("transformers")) >= Version("5.24.0.dev0") else CACHE_NAMES[1]


# The name the installed transformers' own models and `generate` take: `model(**{CACHE: cache})`.
CACHE = _installed_cache_name()


def cache_name(fn: Any) -> str:
    """The name under which `fn` (an upstream forward) takes the KV cache."""
    params = inspect.signature(fn).parameters
    return next((n for n in CACHE_NAMES if n in params), CACHE_NAMES[-1])


def cache_of(kwargs: dict) -> Any:
    """The KV cache of a call's keyword arguments, under either name."""
    return next((kwargs[n] for n in CACHE_NAMES if kwargs.get(n) is not None), None)


def output_cache(output: Any) -> Any:
    """The KV cache a model output returned, under either name."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values
