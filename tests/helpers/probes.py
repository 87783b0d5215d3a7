"""Probes of the work a forward does: host syncs (tensor values copied to the host) and the aten
ops it dispatches, counted while a block runs."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that copy a value to the host (a device sync on an accelerator).
SYNCS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
# Routing work a decode step must not do: ranking, gathering or scattering tokens.
ROUTING_OPS = {"topk", "sort", "argsort", "index", "index_put", "index_put_", "gather", "scatter", "scatter_"}


@contextlib.contextmanager
def count_syncs() -> Iterator[Counter]:
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name: str, original):  # noqa: ANN001, ANN202
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(name, original))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class CountOps(TorchDispatchMode):
    """Every aten op dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

