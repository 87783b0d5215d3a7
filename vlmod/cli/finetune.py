"""`vlmod finetune` / `scripts/finetune.py` (what `accelerate launch` runs): a YAML of `TrainConfig`
settings (`--config`) plus flags that override them, and the run (`vlmod.training.train`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from vlmod.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, MODEL_FLAG, SubParsers
from vlmod.config import DTYPES
from vlmod.errors import TrainError
from vlmod.training.checkpoints import latest_checkpoint
from vlmod.training.config import LR, PRECISIONS, ROUTER_ONLY_LR, TRACKERS, TRAINABLE, TrainConfig
from vlmod.training.fsdp import plan_run
from vlmod.training.train import train


def add_finetune_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod finetune`: fine-tune a (converted) LLaVA model; also `accelerate launch scripts/finetune.py`."""
    p = subparsers.add_parser(
        "finetune",
        help="fine-tune a (MoD-converted) LLaVA model on LLaVA-format data",
        description="Fine-tune with Accelerate: routers only, routers + language model, LoRA, or full. "
        "Settings from --config YAML (configs/finetune/), flags override them.",
    )
    add_config_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plan", action="store_true",
                   help="print what the run needs per GPU on 1, 2, 4 and 8 GPUs under DDP, FSDP2 and ZeRO-3 (with "
                   "and without CPU offload) and exit: loads the model and a batch, trains nothing (default: off)")
    p.set_defaults(run=run_finetune, model_flags=MODEL_FLAG)
    return p


_OVERRIDES: tuple[tuple[str, Any, str], ...] = (
    ("model", str, "checkpoint directory or hub id"),
    ("data", str, "LLaVA-format training JSON"),
    ("val_data", str, "LLaVA-format validation JSON (validation loss every --eval-steps)"),
    ("image_root", str, "folder image/video paths are relative to (default: the JSON's folder)"),
    ("output_dir", str, "where checkpoints/, model/ and train_log.json go"),
    ("trainable", str, f"what trains: {', '.join(TRAINABLE)}; always in float32 master weights (full: 16 bytes a "
     "parameter with AdamW)"),
    ("dtype", str, f"dtype of the frozen weights ({', '.join(DTYPES)}): auto keeps the checkpoint's"),
    ("lr", float, f"learning rate (default: {LR}; {ROUTER_ONLY_LR} with --trainable router, as "
     "configs/finetune/llava-1.5-7b-router.yaml)"),
    ("router_lr", float, "learning rate of the routers (default: --lr)"),
    ("max_steps", int, "optimizer steps (default: --epochs)"),
    ("epochs", float, "epochs when --max-steps is not set"),
    ("batch_size", int, "samples per process per micro-batch"),
    ("gradient_accumulation_steps", int, "micro-batches per optimizer step"),
    ("mixed_precision", str, f"{', '.join(PRECISIONS)} (bf16 with --dtype auto loads a float16 checkpoint's frozen "
     "weights in bfloat16)"),
    ("save_steps", int, "accelerator.save_state every N steps (0: never)"),
    ("eval_steps", int, "validation loss every N steps (0: never)"),
    ("log_steps", int, "log loss / lr / skip rate every N steps"),
    ("seed", int, "seed of the init, the shuffle and dropout"),
    ("resume", str, "'latest' or a checkpoint directory: continue that run (a changed --lr, --max-steps, "
     "data or other setting is refused, naming it)"),
)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags that fill a TrainConfig: `--config` (a YAML) plus overrides, each --help with its default."""
    parser.add_argument("--config", help="YAML of TrainConfig settings (configs/finetune/*.yaml)")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name, kind, help_text in _OVERRIDES:
        default = defaults[name]
        if "default" not in help_text:  # the flag's own default is None: the YAML may set it
            shown = (
                "no default: required, here or in --config" if default is dataclasses.MISSING
                else f"default: {'not set' if default is None else default}"
            )
            help_text = f"{help_text} ({shown})"
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=help_text)
    parser.add_argument("--report-to", dest="report_to", action="append", default=None,
                        help=f"accelerate tracker ({', '.join(TRACKERS)}); repeat for several")
    parser.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action="store_true", default=None,
                        help="recompute activations in the backward pass: less memory, slower (default: off)")
    parser.add_argument("--overwrite", dest="overwrite", action="store_true", default=None,
                        help="delete what an earlier run left in --output-dir (checkpoints, model, logs) first")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The YAML of `--config` with the command-line overrides on top."""
    names = [o[0] for o in _OVERRIDES] + ["report_to", "gradient_checkpointing", "overwrite"]
    return TrainConfig.from_yaml(args.config, **{name: getattr(args, name, None) for name in names})


def _leave_process_group() -> None:
    """A launched process leaves its process group before it exits. Left to the interpreter's
    shutdown, gloo's threads were once torn down mid-join on a loaded machine ("terminate called
    without an active exception": the process aborted after saving, and the launcher reported the
    whole run failed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_finetune(args: argparse.Namespace) -> int:
    """Build the config, train, say where the model went; bad input is one `error:` line."""
    try:
        return _finetune(args)
    finally:
        _leave_process_group()


def _finetune(args: argparse.Namespace) -> int:
    cfg = None
    try:
        cfg = config_from_args(args)
        if args.plan:
            print(plan_run(cfg))
            return 0
        result = train(cfg, progress=not args.no_progress)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        kept = latest_checkpoint(cfg.output_dir) if cfg is not None else None
        then = (f"checkpoint {kept.name} is kept: continue with --resume latest" if kept else
                "no checkpoint was saved yet (set --save-steps to keep some)")
        print(f"error: interrupted (Ctrl-C); {then}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not result.main_process:
        return 0
    ran = result.step - result.start_step  # this process's steps, not the resumed checkpoint's
    summary = f"{ran} step{'s' * (ran != 1)} in {result.seconds:.0f} s"
    if result.start_step:
        summary += f" (resumed from step {result.start_step}, now at step {result.step})"
    if result.loss is not None:
        summary += f", loss {result.loss:.4f}"
    if result.val_loss is not None:
        summary += f", validation loss {result.val_loss:.4f}"
    if result.routed_fraction is not None:
        summary += f", routed fraction {result.routed_fraction:.3f}"
    print(f"{summary}; model saved to {result.model_dir}")
    return 0


__all__ = ["add_config_arguments", "add_finetune_parser", "config_from_args", "run_finetune"]
