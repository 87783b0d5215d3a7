"""One vision-tower pass per evaluation batch instead of two.

An evaluation batch runs the model twice on the same media: the teacher-forced pass that scores
the reference answer, then the generation's prefill. The tower's output is the same both times,
and on a small language model the tower is much of the prefill (the video recipe's tiny model:
0.31 of 0.71 GFLOPs dense, 0.31 of 0.45 at 3x fewer language-model FLOPs), so while
`reusing_tower(model)` is entered the tower hands back its last output when called again on an
input holding the same values (same shape, dtype, device, autocast and arguments; it keeps a copy
of the input it compares with). The numbers are the ones two passes give: a frozen tower in eval mode is a
function of its input.

It stays out of the way wherever that could differ or be seen: a tower with MoD layers (a random
router draws anew, the routing trace reads each pass), one in training mode, and one with hooks
(a pre-LLM reduction reads a layer's input through one) runs every call. The prefill FLOPs the
evaluation reports are counted from the inputs, not from the calls made, and latency is timed
outside it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.io.hf import patch_forward, vision_tower
from vlmod.routing.layer import MoDLayer

# transformers 5 records a tower's hidden states and attentions through forward hooks of this name,
# installed on its first call and left in place.
_RECORDER = "output_capturing_hook"


@contextlib.contextmanager
def reusing_tower(model: nn.Module) -> Iterator[bool]:
    """While inside, `model`'s vision tower reuses its last output for an input of equal values;
    yields whether it does (False: no tower, a routed one, or one in training mode)."""
    tower = vision_tower(model)
    if tower is None or tower.training or any(isinstance(m, MoDLayer) for m in tower.modules()):
        yield False
        return
    reuse = _TowerReuse(tower)
    try:
        yield True
    finally:
        reuse.close()


class _TowerReuse:
    """The tower's last input (a copy) and output; an instance `forward` over the one it had."""

    def __init__(self, tower: nn.Module):
        self.tower, self.forward = tower, tower.forward
        self.kept: tuple[tuple, Tensor, Any] | None = None
        self.restore = patch_forward(tower, self.call)

    def close(self) -> None:
        self.restore()
        self.kept = None

    def hooked(self) -> bool:
        """Whether a hook other than transformers' own output recorders (which fill the hidden
        states and attentions the kept output already holds) watches the tower."""
        return any(getattr(hook, "__name__", "") != _RECORDER for m in self.tower.modules()
                   for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))

    def call(self, *args: Any, **kwargs: Any) -> Any:
        key = _key(args, kwargs)
        if key is None or self.hooked():
            self.kept = None
            return self.forward(*args, **kwargs)
        if self.kept is not None:
            kept_key, x, out = self.kept
            if kept_key == key and torch.equal(x, args[0]):
                return copy.copy(out)  # a shallow copy: LLaVA sets the output's pooler_output
        out = self.forward(*args, **kwargs)
        self.kept = (key, args[0].detach().clone(), out)  # a copy: the caller may change its input in place
        return out


def _key(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """What besides the input's values decides the output; None for a call not to reuse (more than
    one positional input, or a tensor among the keyword arguments)."""
    if len(args) != 1 or not isinstance(args[0], Tensor) or any(isinstance(v, Tensor) for v in kwargs.values()):
        return None
    x, device = args[0], args[0].device.type
    return (tuple(x.shape), x.dtype, x.device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            torch.is_grad_enabled(), sorted(kwargs.items()))


__all__ = ["reusing_tower"]
