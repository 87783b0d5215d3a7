"""`trace_routing`: what each MoD layer processed, for tests, audits and the demo."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from vlmod.routing.layer import PART_ATTR, MoDPart

Key = tuple[str, int]


def find_parts(model: nn.Module) -> list[MoDPart]:
    """The converted parts of a model, outermost first."""
    return [m.__dict__[PART_ATTR] for m in model.modules() if PART_ATTR in m.__dict__]


class RoutingTrace:
    """Per MoD layer, the processed mask and router scores of the traced forwards.

    Several forwards in one trace (the prefill and decode steps of `generate`) are concatenated
    along the token axis; `steps` keeps them apart.
    """

    def __init__(self) -> None:
        self.steps: list[dict[Key, tuple[Tensor, Tensor]]] = []
        self._types: dict[str, list[Tensor]] = {}
        self._open: dict[Key, tuple[Tensor, Tensor]] | None = None

    def record(self, part: str, layer: int, processed: Tensor, scores: Tensor, token_types: Tensor) -> None:
        key = (part, layer)
        if self._open is None or key in self._open:
            self._open = {}
            self.steps.append(self._open)
            self._types.setdefault(part, [])
        if not any(k[0] == part for k in self._open):
            self._types.setdefault(part, []).append(token_types.detach())
        self._open[key] = (processed.detach(), scores.detach())

    @staticmethod
    def _cat(chunks: list[Tensor], what: str) -> Tensor:
        if len(chunks) == 1:
            return chunks[0]
        if len({c.shape[0] for c in chunks}) > 1:
            raise ValueError(
                f"the traced forwards have different batch sizes, so {what} cannot be joined; "
                "trace one forward (or one generate call) at a time, or read trace.steps"
            )
        return torch.cat(chunks, dim=1)

    def _collect(self, slot: int, what: str) -> dict[Key, Tensor]:
        keys = dict.fromkeys(k for step in self.steps for k in step)
        return {
            k: self._cat([step[k][slot] for step in self.steps if k in step], what) for k in keys
        }

    @property
    def processed(self) -> dict[Key, Tensor]:
        """{(part, layer_idx): BoolTensor[B, L]}, True where the token ran the layer."""
        return self._collect(0, "processed")

    @property
    def scores(self) -> dict[Key, Tensor]:
        """{(part, layer_idx): FloatTensor[B, L]}: the learned router logits."""
        return self._collect(1, "scores")

    @property
    def token_types(self) -> Tensor | None:
        """LongTensor[B, L] of `TokenType` values: the language part's, else the only part's."""
        part = "language" if "language" in self._types else next(iter(self._types), None)
        return None if part is None else self.part_token_types(part)

    def first_step(self) -> RoutingTrace:
        """A trace of the first traced forward only: the prefill of a `generate` call."""
        first = RoutingTrace()
        if self.steps:
            first.steps = [self.steps[0]]
            first._types = {part: chunks[:1] for part, chunks in self._types.items()}
        return first

    def part_token_types(self, part: str) -> Tensor:
        return self._cat(self._types[part], "token_types")


@contextmanager
def trace_routing(model: nn.Module) -> Iterator[RoutingTrace]:
    """Record what each MoD layer of `model` processes while the block runs."""
    parts = find_parts(model)
    if not parts:
        raise ValueError("trace_routing: this model has no MoD layers; convert it with vlmod.apply_mod first")
    trace = RoutingTrace()
    previous = [p.trace for p in parts]
    for p in parts:
        p.trace = trace
    try:
        yield trace
    finally:
        for p, prev in zip(parts, previous, strict=True):
            p.trace = prev
