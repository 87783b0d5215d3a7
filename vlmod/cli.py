"""The `vlmod` command. `scripts/*.py` are thin wrappers that call `main` with their subcommand.

Layout: every subcommand has a function that builds its parser (`add_<name>_parser(subparsers)`)
and sets `run=<function(args) -> int>` as its default; `COMMANDS` lists the top-level builders.
Adding a command (convert, rank, finetune, evaluate, demo, audit) or a benchmark (bench llava,
bench video) is one builder plus one run function, registered in `COMMANDS` or `BENCHMARKS`.

Bad input (an unknown model, a capacity outside (0, 1], a malformed flag) ends with a single
`error: ...` line on stderr and exit status 2, never a traceback. Errors past input validation
are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from vlmod.argtypes import (
    HelpFormatter,
    add_dtype_argument,
    device,
    non_negative_int,
    option,
    port,
    positive_float,
    positive_int,
)
from vlmod.bench import (
    CACHES,
    DEFAULT_CACHE,
    LLAVA_PRESETS,
    VIDEO_PRESETS,
    bench_llava,
    bench_video,
    bench_vit,
    format_generation_result,
    format_video_result,
    format_vit_result,
    parse_layers,
)
from vlmod.config import ROUTERS
from vlmod.errors import InputError
from vlmod.fileio import write_json
from vlmod.paths import check_model_arg

EXIT_USAGE = 2
# Arguments that name a checkpoint (a local directory or a hub id), as (dest, flag): a command sets
# `model_flags` and `main` checks them before any work, so that a hub id off the network is one
# line within seconds (vlmod.paths.check_model_arg), not transformers' retry loop.
MODEL_FLAG = (("model", "--model"),)

SubParsers = Any  # argparse._SubParsersAction, which argparse does not export


class UsageError(Exception):
    """Bad input from the command line: reported as `error: <message>`, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a parse error is one `error: ...` line (argparse prints usage + message), and
    every `--help` shows the defaults and hides the old spellings (`vlmod.argtypes.HelpFormatter`).
    Subcommand parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _capacity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"capacity must be in (0, 1] (the fraction of routable tokens a MoD layer processes), got {text}"
        )
    return value






def _layers(text: str) -> str | list[int]:
    try:
        return parse_layers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------- bench


def add_bench_vit_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench vit`: dense vs MoD images/s of a ViT image encoder against the FLOPs prediction."""
    p = subparsers.add_parser(
        "vit",
        help="dense vs MoD throughput of a timm / open_clip ViT",
        description="Measure images/s of a randomly initialised ViT and of its MoD conversion on one "
        "random batch (dense and MoD runs interleaved), and compare the measured speedup with "
        "the FLOPs prediction.",
    )
    p.add_argument(
        "--model", required=True, help="timm model name (vit_base_patch16_224) or open_clip name (ViT-B-16)"
    )
    p.add_argument(
        "--source", choices=("timm", "open_clip"), default="timm", help="model library (default: timm)"
    )
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=8,
           help="images per forward (default: 8)")
    p.add_argument(
        "--capacity",
        type=_capacity,
        default=0.125,
        help="fraction of patch tokens a MoD layer processes (default: 0.125)",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default="every_other",
        help="every_other | all | comma list of block indices (default: every_other)",
    )
    p.add_argument(
        "--image-size", type=positive_int, default=None, help="input resolution (default: the model's)"
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=3,
        help="untimed forwards of each model first (default: 3)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="timed forwards of each model (default: 10)"
    )
    p.add_argument(
        "--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch (default: 0)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_bench_vit)
    return p


def run_bench_vit(args: argparse.Namespace) -> int:
    result = bench_vit(
        args.model,
        source=args.source,
        batch=args.batch,
        capacity=args.capacity,
        layers=args.layers,
        image_size=args.image_size,
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(format_vit_result(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _add_timing_arguments(p: argparse.ArgumentParser, warmup: int, repeats: int) -> None:
    p.add_argument("--warmup", type=non_negative_int, default=warmup, help=f"untimed runs first (default: {warmup})")
    p.add_argument("--repeats", type=positive_int, default=repeats, help=f"timed runs (default: {repeats})")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_cache_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache", choices=CACHES, default=DEFAULT_CACHE,
        help="KV cache both models generate with: preallocated (vlmod.preallocated_cache, written in place) "
        f"or dynamic (transformers' DynamicCache, concatenated every step) (default: {DEFAULT_CACHE})",
    )
    p.add_argument(
        "--decode-bound", action="store_true",
        help="also decode in lockstep with MoD's router and gate bypassed (a copy of the MoD model whose layers "
        "run their blocks ungated over the same small caches in decode steps): what MoD could decode at if "
        "routing cost nothing (default: off; a third model over the same weights; needs --new-tokens >= 2)",
    )


def add_bench_llava_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench llava`: dense vs MoD prefill, decode and KV cache of a LLaVA model."""
    p = subparsers.add_parser(
        "llava",
        help="dense vs MoD prefill latency, decode tokens/s and KV cache of a LLaVA model",
        description="Run a LLaVA checkpoint (or a preset with LLaVA-1.5's token shapes and random "
        "weights) dense and converted to MoD on one synthetic image per prompt, and compare the measured "
        "prefill speedup with the FLOPs prediction; decode is timed per step inside generate, and the KV "
        "cache and peak memory are compared. A converted checkpoint is measured with its own MoD layers.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint directory or hub id")
    source.add_argument(
        "--preset", choices=sorted(LLAVA_PRESETS), default="llava-1.5", help="model built from config (default: llava-1.5)"
    )
    p.add_argument(
        "--capacity", type=_capacity, default=None,
        help="fraction of image tokens per MoD layer (default: 0.5; a converted --model is measured with its own)",
    )
    p.add_argument(
        "--layers", type=_layers, default=None,
        help="every_other | all | comma list (default: every_other; a converted --model is measured with its own)",
    )
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=1,
           help="prompts per batch (default: 1)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate (default: 16)")
    _add_cache_argument(p)
    _add_timing_arguments(p, warmup=1, repeats=5)
    p.set_defaults(run=run_bench_llava, model_flags=MODEL_FLAG)
    return p


def run_bench_llava(args: argparse.Namespace) -> int:
    result = bench_llava(
        model=args.model, preset=args.preset, capacity=args.capacity, layers=args.layers, batch=args.batch,
        new_tokens=args.new_tokens, warmup=args.warmup, repeats=args.repeats, threads=args.threads,
        progress=not args.no_progress, cache=args.cache, decode_bound=args.decode_bound,
    )
    print(format_generation_result(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def add_bench_video_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench video`: dense vs MoD video question answering, end to end."""
    p = subparsers.add_parser(
        "video",
        help="dense vs MoD frames/s of a video LLaVA model, end to end",
        description="Run a LlavaNextVideo / LlavaOnevision checkpoint (or a preset with LLaVA-NeXT-Video-7B's "
        "token shapes and random weights) dense and converted to MoD on a video clip: frame decoding, "
        "preprocessing, vision tower, prefill and generation, timed interleaved. Reports end-to-end "
        "frames/s, where the time goes, and the measured prefill speedup against the FLOPs prediction.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="LlavaNextVideo or LlavaOnevision checkpoint directory or hub id")
    source.add_argument(
        "--preset", default="llava-next-video-7b",
        help=f"model built from config: {' | '.join(sorted(VIDEO_PRESETS))} (default: llava-next-video-7b)",
    )
    p.add_argument("--video", default=None, help="video file (default: a generated 3 s clip)")
    p.add_argument("--frames", type=positive_int, default=8, help="frames sampled uniformly from the clip (default: 8)")
    option(p, "--batch-size", aliases=("--batch",), dest="batch", type=positive_int, default=1,
           help="clips per batch (default: 1)")
    p.add_argument(
        "--capacity", type=_capacity, default=None,
        help="fraction of video tokens per MoD layer (default: 0.5; a converted --model is measured with its own)",
    )
    p.add_argument(
        "--layers", type=_layers, default=None,
        help="every_other | all | comma list (default: every layer but the first two and the last; "
        "a converted --model is measured with its own)",
    )
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate (default: 16)")
    _add_cache_argument(p)
    _add_timing_arguments(p, warmup=1, repeats=5)
    p.set_defaults(run=run_bench_video, model_flags=MODEL_FLAG)
    return p


def run_bench_video(args: argparse.Namespace) -> int:
    result = bench_video(
        model=args.model, preset=args.preset, video=args.video, frames=args.frames, batch=args.batch,
        capacity=args.capacity, layers=args.layers, new_tokens=args.new_tokens, warmup=args.warmup,
        repeats=args.repeats, threads=args.threads, progress=not args.no_progress, cache=args.cache,
        decode_bound=args.decode_bound,
    )
    print(format_video_result(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


# Benchmarks under `vlmod bench`.
BENCHMARKS: list[Callable[[SubParsers], argparse.ArgumentParser]] = [
    add_bench_vit_parser, add_bench_llava_parser, add_bench_video_parser,
]


def add_bench_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench <benchmark>`."""
    p = subparsers.add_parser("bench", help="benchmarks: measured vs predicted MoD speedup")
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for add in BENCHMARKS:
        add(sub)
    return p


# ----------------------------------------------------------------------------- convert, rank


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
    p.add_argument("--capacity", type=_capacity, default=None, help="fraction of image tokens per MoD layer (default: 0.5)")
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
    p.add_argument("--vision-capacity", type=_capacity, default=None, help="also convert the vision tower at this capacity")
    p.add_argument("--vision-layers", type=_layers, default=None, help="vision tower layers (default: every_other)")
    add_dtype_argument(p, default=None)
    p.add_argument("--max-shard-size", default=None,
                   help="largest weights file written, as transformers' save_pretrained (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(run=run_convert, model_flags=MODEL_FLAG)
    return p


def _arank_layers(args: argparse.Namespace, spec: str) -> list[int]:
    from vlmod import arank, rank_cli

    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise UsageError(f"--layers {spec!r}: expected arank:N with N an integer") from None
    if args.ranks:
        if not Path(args.ranks).is_file():
            raise UsageError(f"--ranks {args.ranks} does not exist")
        return arank.LayerRanks.from_json(args.ranks).select(n=n)
    if not args.calib_data:
        raise UsageError("--layers arank:N needs --ranks ranks.json or --calib-data DATA")
    return rank_cli.rank_checkpoint(
        args.model, args.calib_data, image_root=args.calib_image_root, prompt=args.calib_prompt,
        num_samples=args.calib_samples,
    ).select(n=n)


def run_convert(args: argparse.Namespace) -> int:
    from vlmod.convert import ConvertError, ConvertOptions, convert

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


def add_rank_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod rank`: ARank of each layer, and the layers it suggests converting."""
    from vlmod.rank_cli import add_rank_arguments, run_rank

    p = _module_command(
        subparsers, "rank", add_rank_arguments,
        help="rank layers by the rank of their attention maps (ARank)",
        description="Calibrate a model on real inputs and rank its layers by attention-map rank: low rank "
        "means redundant, a good layer to convert.",
    )
    p.set_defaults(run=run_rank, model_flags=MODEL_FLAG)
    return p


def add_data_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod data synthetic`: write the synthetic image-text set."""
    from vlmod.data.synthetic import add_make_data_arguments

    p = subparsers.add_parser("data", help="make datasets (the synthetic shapes set)",
                              description="Write datasets vlmod can generate itself.")
    sets = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    _module_command(
        sets, "synthetic", add_make_data_arguments,
        help="coloured shapes on textured backgrounds, with colour / shape / count / position questions",
        description="Write the deterministic synthetic LLaVA-format QA set (and its video variant).",
    )
    return p


def _module_command(
    subparsers: SubParsers, name: str, add_arguments: Callable[[argparse.ArgumentParser], Any], help: str, description: str
) -> argparse.ArgumentParser:
    """A subcommand whose flags and run function live in its module (`add_arguments` sets `run`)."""
    p = subparsers.add_parser(name, help=help, description=description)
    add_arguments(p)
    return p


def add_finetune_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod finetune`: fine-tune a (converted) LLaVA model; also `accelerate launch scripts/finetune.py`."""
    from vlmod.train import add_finetune_arguments

    p = _module_command(
        subparsers, "finetune", add_finetune_arguments,
        help="fine-tune a (MoD-converted) LLaVA model on LLaVA-format data",
        description="Fine-tune with Accelerate: routers only, routers + language model, LoRA, or full. "
        "Settings from --config YAML (configs/finetune/), flags override them.",
    )
    p.set_defaults(model_flags=MODEL_FLAG)
    return p


def add_eval_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod eval`: accuracy against compute, optionally side by side with a dense model."""
    from vlmod.eval import add_evaluate_arguments

    p = _module_command(
        subparsers, "eval", add_evaluate_arguments,
        help="evaluate accuracy, answer loss, processed fraction, FLOPs and latency on LLaVA-format QA data",
        description="Evaluate a (converted) LLaVA model; --compare puts a second model (the dense original) "
        "side by side in one table.",
    )
    p.set_defaults(model_flags=(("model", "--model"), ("compare", "--compare")))
    return p


def add_recipe_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod recipe`: the synthetic recipe end to end (the README's Results)."""
    from vlmod.recipe_cli import add_recipe_arguments

    return _module_command(
        subparsers, "recipe", add_recipe_arguments,
        help="the synthetic recipe: data, dense from scratch, ARank, convert, fine-tune, evaluate, baselines",
        description="Run the offline synthetic recipe end to end into --out and write results.md / results.json.",
    )


def add_tiny_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod tiny`: a random tiny LLaVA saved like a hub checkpoint (training from scratch, tests)."""
    from vlmod.tiny import add_tiny_arguments

    return _module_command(
        subparsers, "tiny", add_tiny_arguments,
        help="write a randomly initialised tiny LLaVA model + processor (no download)",
        description="Write a tiny LLaVA-family model with an offline word-level tokenizer and processor: "
        "the starting point of the synthetic recipe.",
    )


def add_pretrain_tower_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod pretrain-tower`: a tiny LLaVA's tower learns the synthetic scenes' patches first."""
    from vlmod.tower_pretrain import add_pretrain_tower_arguments

    p = _module_command(
        subparsers, "pretrain-tower", add_pretrain_tower_arguments,
        help="pretrain a tiny LLaVA's vision tower on what each patch of the synthetic images shows",
        description="Train the vision tower to tell each patch's object (shape and colour, or background) on "
        "`vlmod data synthetic` images, as LLaVA starts from a pretrained CLIP; saves the whole LLaVA.",
    )
    p.set_defaults(model_flags=MODEL_FLAG)
    return p


# ----------------------------------------------------------------------------- demo


def add_demo_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod demo`: the web demo (needs the `demo` extra)."""
    p = subparsers.add_parser(
        "demo",
        help="web demo: which vision tokens each MoD layer runs, on your images and videos",
        description="Serve the vlmod web demo: upload an image or a video (or pick an example), ask a "
        "question, and see per patch how many MoD layers ran each vision token. Without --model it "
        "serves the embedded tiny model trained on the synthetic set.",
    )
    p.add_argument("--model", default=None, help="converted checkpoint directory or hub id (default: the embedded demo model)")
    p.add_argument("--dense", default=None, help="dense checkpoint (directory or hub id) to compare answers and "
                   "latency with (default: the embedded dense model when --model is not given)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default: 8000)")
    p.add_argument("--max-upload-mb", type=positive_float, default=25.0, help="largest upload in MB (default: 25)")
    p.add_argument(
        "--max-active", type=positive_int, default=2,
        help="requests decoding / running at once; bounds memory (default: 2)",
    )
    p.add_argument(
        "--max-waiting", type=non_negative_int, default=8,
        help="requests queued for a turn; more get 503 (default: 8)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="answer length in tokens (default: 16)")
    p.add_argument("--frames", type=positive_int, default=8, help="frames sampled from a video (default: 8)")
    p.add_argument("--device", type=device, default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--timing-runs", type=non_negative_int, default=3, help="timed generate runs per model per "
                   "request, MoD and dense interleaved, median shown; 0 = no latency (default: 3)")
    p.set_defaults(run=run_demo, model_flags=(("model", "--model"), ("dense", "--dense")))
    return p


def run_demo(args: argparse.Namespace) -> int:
    try:
        from vlmod.demo.app import DemoSetupError, serve
    except ImportError as e:
        raise UsageError(f"the demo needs its extra: pip install 'vlmod[demo]' ({e})") from None
    try:
        serve(
            args.model, args.dense, host=args.host, port=args.port, max_upload_mb=args.max_upload_mb,
            max_new_tokens=args.max_new_tokens, num_frames=args.frames, device=args.device,
            max_active=args.max_active, max_waiting=args.max_waiting, timing_runs=args.timing_runs,
        )
    except (DemoSetupError, FileNotFoundError, TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    return 0


# ----------------------------------------------------------------------------- audit


def add_audit_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod audit`: learned routing against counterfactual and training-free routers."""
    from vlmod.audit import add_audit_arguments

    p = _module_command(
        subparsers, "audit", add_audit_arguments,
        help="compare the learned router with inverted / random / stride / attention routing",
        description="With the weights fixed, swap the router of a converted model at inference and report "
        "accuracy and answer loss for each, the cross-layer Jaccard agreement of processed tokens, compute "
        "by token position and type, PNG plots and a written verdict.",
    )
    p.set_defaults(model_flags=MODEL_FLAG)
    return p


# ----------------------------------------------------------------------------- scale-check


def add_scale_check_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod scale-check`: every stage on a checkpoint of the real 7B shapes, memory and time each."""
    from vlmod.scale import SHAPES
    from vlmod.scale_check import STAGES

    p = subparsers.add_parser(
        "scale-check",
        help="run every stage on a checkpoint of the real 7B shapes: wall time and peak memory each",
        description="Build a LLaVA-1.5-7B- or LLaVA-NeXT-Video-7B-shaped checkpoint (the real configs and "
        "processor shapes, random bfloat16 weights: 13.5 GB for 32 layers) and run each stage as its command in "
        "a process of its own: convert, load, rank, eval, lmms-eval, the demo with one request, router and "
        "LoRA fine-tunes, bench. Prints and writes a table (stage, wall time, peak RSS, checkpoint bytes, ratio).",
    )
    p.add_argument("--shape", choices=SHAPES, default=SHAPES[0], help=f"model shape (default: {SHAPES[0]})")
    p.add_argument("--workdir", default="scale-check",
                   help="folder for the checkpoints, data, logs and table (default: scale-check)")
    p.add_argument("--layers", type=positive_int, default=32,
                   help="language layers (default: 32, the real model; fewer for a quicker look)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of stages (default: {','.join(STAGES)})")
    p.add_argument("--keep", action="store_true", help="keep the fine-tuned models (default: delete each once measured)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_scale_check)
    return p


def run_scale_check(args: argparse.Namespace) -> int:
    from vlmod.scale_check import format_table, scale_check

    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    rows = scale_check(args.shape, args.workdir, layers=args.layers, stages=stages, keep=args.keep,
                       progress=not args.no_progress)
    print(format_table(rows))
    print(f"wrote {Path(args.workdir) / f'{args.shape}-{args.layers}' / 'scale_check.md'}")
    return 0 if all(r.returncode == 0 for r in rows) else 1


# ----------------------------------------------------------------------------- main

# Top-level subcommands.
COMMANDS: list[Callable[[SubParsers], argparse.ArgumentParser]] = [
    add_convert_parser, add_rank_parser, add_bench_parser, add_finetune_parser, add_eval_parser,
    add_audit_parser, add_demo_parser, add_recipe_parser, add_data_parser, add_tiny_parser,
    add_pretrain_tower_parser, add_scale_check_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vlmod", description="Mixture-of-Depths routing for vision-language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `vlmod` command; returns the exit status (0, or 2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        for dest, flag in getattr(args, "model_flags", ()):
            check_model_arg(getattr(args, dest, None), flag)
        return args.run(args)
    except (UsageError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
