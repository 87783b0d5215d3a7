"""The routing engine: router and gate, token selection, gather/scatter, schedules, aux loss, trace."""

from vlmod.routing.api import (
    apply_mod,
    mod_layers,
    remove_mod,
    router_aux_loss,
    set_capacity,
    set_router,
    use_router,
)
from vlmod.routing.attention import AttentionQK, attention_keys, received_attention
from vlmod.routing.router import Router, gate
from vlmod.routing.schedule import capacity_to_k, layer_capacities
from vlmod.routing.selection import Selection, TokenLayout, select_tokens
from vlmod.routing.trace import RoutingTrace, trace_routing

__all__ = [
    "AttentionQK",
    "Router",
    "RoutingTrace",
    "Selection",
    "TokenLayout",
    "apply_mod",
    "attention_keys",
    "capacity_to_k",
    "gate",
    "layer_capacities",
    "mod_layers",
    "received_attention",
    "remove_mod",
    "router_aux_loss",
    "select_tokens",
    "set_capacity",
    "set_router",
    "trace_routing",
    "use_router",
]
