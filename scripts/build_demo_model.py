#!/usr/bin/env python
"""Build the demo's embedded default model: the synthetic video recipe's fine-tuned MoD model and
its dense original, copied into vlmod/demo/assets/{model,dense} (what `vlmod demo` serves with no
--model).

    python scripts/build_demo_model.py                             # runs the video recipe first
    python scripts/build_demo_model.py --from runs/synthetic-video # reuses a finished recipe run

The dense original is the model the MoD one was converted from (the refined dense model where
the recipe refines it). The MoD model is saved at the recipe's main compute point (3x fewer language-model prefill
FLOPs). It was trained on clips, where only video tokens are routable; the installed copy routes
image tokens too (its `routable` gains "image"), so an uploaded picture shows its routing as well.

The recipe is deterministic on a given machine, so this reproduces the shipped checkpoint (up to
floating-point differences between CPUs).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from vlmod.cli.argtypes import HelpFormatter
from vlmod.demo.app import DEFAULT_DENSE_DIR, DEFAULT_MODEL_DIR
from vlmod.errors import InputError
from vlmod.recipes.recipe import RecipeSettings, run_recipe
from vlmod.recipes.reuse import dense_model_dir

KEEP = {"config.json", "generation_config.json", "model.safetensors", "processor_config.json",
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"}


def install(source: Path, target: Path, routable: tuple[str, ...] = ()) -> None:
    """Copy a saved model's files flat into `target`, via a temporary folder; `routable`: token
    types its converted language layers route besides those they were trained with."""
    if not (source / "model.safetensors").is_file():
        raise SystemExit(f"error: {source} holds no model.safetensors: is it a finished recipe run?")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.name in KEEP:
            shutil.copy2(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    language = config.get("vlmod", {}).get("language")
    if routable and language:
        language["routable"] = sorted(set(language["routable"]) | set(routable))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_demo_model.py", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--from", dest="run", help="a finished recipe run (default: run the recipe into --out)")
    parser.add_argument("--out", default="runs/synthetic-video",
                        help="where to run the recipe (default: runs/synthetic-video)")
    parser.add_argument("--task", default="video", choices=("image", "video"),
                        help="which recipe to run when --from is not given (default: video)")
    args = parser.parse_args(argv)
    run = Path(args.run) if args.run else Path(args.out)
    if not args.run:
        try:  # a new or empty --out: an earlier run there is used with --from, never trained over
            run_recipe(run, RecipeSettings.for_task(args.task))
        except InputError as e:
            raise SystemExit(f"error: {e} (this script: --from {run} installs the models of a run there)") from None
    install(run / "mod" / "model", DEFAULT_MODEL_DIR, routable=("image", "video"))
    install(dense_model_dir(run), DEFAULT_DENSE_DIR)
    size = sum(f.stat().st_size for d in (DEFAULT_MODEL_DIR, DEFAULT_DENSE_DIR) for f in d.iterdir())
    print(f"installed the demo model ({size / 2**20:.1f} MiB) into {DEFAULT_MODEL_DIR.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
