"""Probes of the work a forward does: host syncs (tensor values copied to the host) and the aten
ops it dispatches (vlmod.bench.ops, where `vlmod bench ops` counts them too)."""

from __future__ import annotations

from vlmod.bench.ops import OpCounter as CountOps
from vlmod.bench.ops import count_host_reads as count_syncs

# Routing work a decode step must not do: ranking, gathering or scattering tokens.
ROUTING_OPS = {"topk", "sort", "argsort", "index", "index_put", "index_put_", "gather", "scatter", "scatter_"}

__all__ = ["ROUTING_OPS", "CountOps", "count_syncs"]
