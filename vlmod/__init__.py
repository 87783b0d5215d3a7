"""vlmod: Mixture-of-Depths routing for existing vision-language models."""

from vlmod.cache import PreallocatedCache, preallocated_cache
from vlmod.config import MoDConfig, TokenType
from vlmod.hf import load_pretrained
from vlmod.routing import (
    apply_mod,
    mod_layers,
    remove_mod,
    router_aux_loss,
    set_capacity,
    set_router,
    trace_routing,
    use_router,
)

__version__ = "0.1.0"

__all__ = [
    "MoDConfig",
    "PreallocatedCache",
    "TokenType",
    "apply_mod",
    "load_pretrained",
    "mod_layers",
    "preallocated_cache",
    "remove_mod",
    "router_aux_loss",
    "set_capacity",
    "set_router",
    "trace_routing",
    "use_router",
]
