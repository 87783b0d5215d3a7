"""vlmod: Mixture-of-Depths routing for existing vision-language models."""

from vlmod.api import (
    apply_mod,
    mod_layers,
    remove_mod,
    router_aux_loss,
    set_capacity,
    set_router,
    use_router,
)
from vlmod.config import MoDConfig, TokenType
from vlmod.io.hf import load_pretrained
from vlmod.routing.trace import trace_routing
from vlmod.tools.cache import CompiledCache, PreallocatedCache, compiled_cache, preallocated_cache
from vlmod.tools.compile import compile

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from vlmod import tiny` (the README's Python API block) predates vlmod.models.
    if name == "tiny":
        from vlmod.models import tiny

        return tiny
    raise AttributeError(f"module 'vlmod' has no attribute {name!r}")


__all__ = [
    "CompiledCache",
    "MoDConfig",
    "PreallocatedCache",
    "TokenType",
    "apply_mod",
    "compile",
    "compiled_cache",
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
