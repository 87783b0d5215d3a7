"""The routing engine: router and gate, token selection, gather/scatter, schedules, aux loss, trace."""

from vlmod.routing.api import apply_mod, mod_layers, remove_mod, router_aux_loss
from vlmod.routing.router import Router, gate
from vlmod.routing.schedule import capacity_to_k, layer_capacities
from vlmod.routing.selection import Selection, TokenLayout, select_tokens
from vlmod.routing.trace import RoutingTrace, trace_routing

__all__ = [
    "Router",
    "RoutingTrace",
    "Selection",
    "TokenLayout",
    "apply_mod",
    "capacity_to_k",
    "gate",
    "layer_capacities",
    "mod_layers",
    "remove_mod",
    "router_aux_loss",
    "select_tokens",
    "trace_routing",
]
