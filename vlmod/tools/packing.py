"""Packing a routed selection into one sequence, for variable-length attention kernels. Not used
by the engine yet: it pays off only with such a kernel (a GPU), and is kept here, checked on the
CPU, for that step.

The padded selection is `[B, K]`: a row that processes fewer tokens than the batch's largest
count fills its tail with filler slots, which attention then computes and throws away. Packed,
the processed tokens of every row sit one after another in a single sequence `[1, N]`
(N = the processed tokens of the whole batch) and a query sees only keys of its own row: causal
by original position in a decoder, every key of the row in a ViT block. That is the layout of
varlen kernels (xformers' `BlockDiagonalCausalMask.from_seqlens(seqlens)`, flash-attention's
`cu_seqlens`); `Packing.mask` materialises it as a dense bool mask (`vlmod.routing.masks`), so
the packed path runs on any attention implementation and can be checked against the padded one
(`tests/tools/test_packing.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlmod.routing import masks


@dataclass
class Packing:
    """Where each processed token of a `[B, K]` selection goes in the packed sequence `[1, N]`."""

    rows: Tensor  # [N] the row of each packed token
    slots: Tensor  # [N] its slot in the padded selection (ascending within a row)
    seqlens: list[int]  # processed tokens per row, in row order
    shape: tuple[int, int]  # (B, K) of the padded selection

    @classmethod
    def of(cls, valid: Tensor | None, shape: tuple[int, int], device: torch.device | None = None) -> Packing:
        """The packing of a selection whose processed slots are `valid` [B, K] (None: every slot);
        one host sync (the row lengths, which varlen kernels take on the host anyway)."""
        batch, k = shape
        if valid is None:
            valid = torch.ones(shape, dtype=torch.bool, device=device)
        rows, slots = valid.nonzero(as_tuple=True)  # row-major: rows in order, slots ascending
        return cls(rows=rows, slots=slots, seqlens=valid.sum(1).tolist(), shape=(batch, k))

    @property
    def total(self) -> int:
        return int(self.rows.shape[0])

    def cu_seqlens(self) -> Tensor:
        """[B + 1] int32 offsets of each row in the packed sequence (flash-attention's varlen form)."""
        lengths = torch.tensor([0, *self.seqlens], dtype=torch.int32, device=self.rows.device)
        return lengths.cumsum(0, dtype=torch.int32)

    def pack(self, t: Tensor) -> Tensor:
        """[B, K, ...] (or [1, K, ...], shared by every row) -> [1, N, ...]."""
        if t.shape[0] != self.shape[0]:
            t = t.expand(self.shape[0], *t.shape[1:])
        return t[self.rows, self.slots].unsqueeze(0)

    def unpack(self, packed: Tensor, fill: Tensor) -> Tensor:
        """A copy of `fill` [B, K, ...] with the packed tokens [1, N, ...] written to their slots."""
        out = fill.clone()
        out[self.rows, self.slots] = packed[0].to(out.dtype)
        return out

    def mask(self, positions: Tensor | None = None, causal: bool = True) -> Tensor:
        """[1, 1, N, N] bool: query i may see key j iff both are of one row and, when `causal`,
        key j's position is not after query i's. `positions` [B, K] are the slots' original
        positions (None: the slot order, which is the position order of a selection)."""
        pos = self.slots if positions is None else self.pack(positions)[0]
        return masks.block_diagonal(self.rows, self.rows, pos if causal else None, pos if causal else None)

