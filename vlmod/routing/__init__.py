"""The routing engine: router and gate, token selection, gather/scatter, schedules, trace.

It knows nothing of model families (vlmod.plugins) or of conversion (vlmod.api)."""

from vlmod.routing.attention import (
    AttentionQK,
    QueryPlan,
    attention_keys,
    by_key_head,
    query_plan,
    received_attention,
)
from vlmod.routing.router import Router, gate
from vlmod.routing.schedule import capacity_to_k, layer_capacities
from vlmod.routing.selection import Selection, TokenLayout, select_tokens
from vlmod.routing.trace import RoutingTrace, trace_routing

__all__ = [
    "AttentionQK",
    "QueryPlan",
    "Router",
    "RoutingTrace",
    "Selection",
    "TokenLayout",
    "attention_keys",
    "by_key_head",
    "capacity_to_k",
    "gate",
    "layer_capacities",
    "query_plan",
    "received_attention",
    "select_tokens",
    "trace_routing",
]
