"""argparse value types and config-file reading shared by every command: one wording for the same
mistake everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for integers >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def fraction(text: str) -> float:
    """A number in (0, 1]: capacities, thresholds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def read_yaml_mapping(path: str | Path, error: type[Exception]) -> dict[str, Any]:
    """The mapping a YAML config file holds; `error` naming the file when it is missing, not YAML,
    or not a mapping."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise error(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data
