"""The family matrix past LLaVA, read from the plugin registry, and how each family is built tiny."""

from __future__ import annotations

from vlmod.plugins import llava, vlm_variants

# Every whole-model variant of the plugin registry but LLaVA's (plugins/test_llava.py has those).
FAMILIES = [v for v in vlm_variants() if v not in llava.VARIANTS]
# tiny.build arguments per family. Patches of 4 px: a 32 x 32 image is 16 merged Qwen tokens.
BUILD: dict[str, dict] = {"qwen2_5_vl": {"patch_size": 4}, "qwen3_vl": {"patch_size": 4}}
