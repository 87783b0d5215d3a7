"""Where the demo's checkpoints come from: a local directory or a Hugging Face hub id. The checks
live in `vlmod.io.paths`, shared by every command (off the network a hub id fails in seconds with one
line, not after transformers' retry loop); this module keeps the demo's names."""

from __future__ import annotations

from vlmod.io.paths import HUB_ID, hub_endpoint, hub_offline, hub_reachable, in_hub_cache, resolve_checkpoint

__all__ = ["HUB_ID", "hub_endpoint", "hub_offline", "hub_reachable", "in_hub_cache", "resolve_checkpoint"]
