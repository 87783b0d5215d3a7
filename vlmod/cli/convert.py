"""`vlmod convert`: a LLaVA checkpoint to MoD, its layers chosen by flag, YAML or ARank
(`vlmod.tools.convert` does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmod.bench import parse_layers
from vlmod.cli.argtypes import add_dtype_argument, byte_size, option, positive_int
from vlmod.cli.common import MODEL_FLAG, SubParsers, UsageError, capacity, layers
from vlmod.config import ROUTERS
from vlmod.io.paths import not_found
from vlmod.tools.arank import LayerRanks
from vlmod.tools.calibrate import rank_checkpoint
from vlmod.tools.convert import ConvertError, ConvertOptions, convert


def add_convert_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod convert`: a LLaVA checkpoint to MoD, saved with its processor and a report."""
    p = subparsers.add_parser(
        "convert",
        help="convert a LLaVA checkpoint to MoD",
        description="Load a LLaVA-family checkpoint, convert the chosen language (and optionally vision) "
        "layers to MoD, and save it with its processor and vlmod_report.json. Flags override --config.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory or hub id")
    p.add_argument("--out", default=None, help="output directory (must be empty or absent, or use --overwrite)")
    p.add_argument("--config", default=None, help="YAML file with the same options (configs/convert/*.yaml)")
    p.add_argument("--capacity", type=capacity, default=None, help="fraction of image tokens per MoD layer (default: 0.5)")
    p.add_argument(
        "--layers", default=None,
        help="every_other | all | comma list | arank:N (the N lowest-ARank layers; needs --ranks or --calib-data)",
    )
    p.add_argument("--ranks", default=None, help="ranks.json from `vlmod rank`, for --layers arank:N")
    p.add_argument("--calib-data", default=None, help="LLaVA-format JSON or image folder to rank layers on, for --layers arank:N")
    p.add_argument("--calib-image-root", default=None, help="image folder of --calib-data JSON")
    p.add_argument("--calib-prompt", default="describe the image .", help="prompt for an image-folder --calib-data")
    option(p, "--num-samples", aliases=("--calib-samples",), dest="calib_samples", type=positive_int, default=64,
           help="calibration samples for --layers arank:N with --calib-data (default: 64)")
    p.add_argument("--routable", default=None, help="comma list of routable token types (default: image,video)")
    p.add_argument(
        "--router", choices=ROUTERS, default=None,
        help="router kind (default: learned); attention routes without fine-tuning (training-free)",
    )
    p.add_argument("--capacity-schedule", choices=("cosine",), default=None, help="per-layer capacity decay")
    p.add_argument("--vision-capacity", type=capacity, default=None, help="also convert the vision tower at this capacity")
    p.add_argument("--vision-layers", type=layers, default=None, help="vision tower layers (default: every_other)")
    add_dtype_argument(p, default=None)
    p.add_argument("--max-shard-size", type=byte_size, default=None,
                   help="largest weights file written, as transformers' save_pretrained (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(run=run_convert, model_flags=MODEL_FLAG)
    return p


def _arank_layers(args: argparse.Namespace, spec: str) -> list[int]:
    """The N lowest-ARank layers of `--layers arank:N`, from `--ranks` or ranked now on `--calib-data`."""
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise UsageError(f"--layers {spec!r}: expected arank:N with N an integer") from None
    if args.ranks:
        if not Path(args.ranks).is_file():
            raise UsageError(f"--ranks {args.ranks} {not_found(args.ranks)}")
        return LayerRanks.from_json(args.ranks).select(n=n)
    if not args.calib_data:
        raise UsageError("--layers arank:N needs --ranks ranks.json or --calib-data DATA")
    return rank_checkpoint(
        args.model, args.calib_data, image_root=args.calib_image_root, prompt=args.calib_prompt,
        num_samples=args.calib_samples,
    ).select(n=n)


def run_convert(args: argparse.Namespace) -> int:
    overrides = {
        "model": args.model, "out": args.out, "capacity": args.capacity, "capacity_schedule": args.capacity_schedule,
        "vision_capacity": args.vision_capacity, "vision_layers": args.vision_layers, "dtype": args.dtype,
        "max_shard_size": args.max_shard_size,
        "overwrite": args.overwrite or None,
        "routable": [t.strip() for t in args.routable.split(",")] if args.routable else None,
        "router": args.router,
    }
    try:
        if args.config:
            options = ConvertOptions.from_yaml(args.config, **overrides)
        else:
            if not args.model or not args.out:
                raise UsageError("--model and --out are required (or give them in --config)")
            options = ConvertOptions(**{k: v for k, v in overrides.items() if v is not None})
        layers = args.layers if args.layers is not None else options.layers
        if isinstance(layers, str) and layers.startswith("arank:"):
            args.model = options.model
            layers = _arank_layers(args, layers)
        options.layers = parse_layers(layers)
        report = convert(options)
    except (ConvertError, ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    layers = report["layers"]
    prediction = report["prediction"]
    print(
        f"converted {report['model_class']} -> {options.out}: language layers "
        f"{','.join(layers['language']) or '-'}"
        + (f", vision layers {','.join(layers['vision'])}" if layers["vision"] else "")
        + f"; {report['parameters']['added']} router parameters added"
    )
    print(
        f"predicted for one image ({prediction['image_tokens']} tokens) + {prediction['prompt_tokens']} prompt tokens: "
        f"prefill {prediction['predicted_speedup']:.2f}x fewer language FLOPs, "
        f"KV cache -{100 * prediction['kv_cache_reduction']:.1f}%"
    )
    return 0


__all__ = ["add_convert_parser", "run_convert"]
