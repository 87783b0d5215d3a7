"""`vlmod tiny`: a randomly initialised tiny LLaVA-family model with an offline processor, saved like a
hub checkpoint (`vlmod.models.tiny`)."""

from __future__ import annotations

import argparse

from vlmod.cli.argtypes import positive_int
from vlmod.cli.common import SubParsers
from vlmod.errors import InputError
from vlmod.io.files import save_pretrained_atomic
from vlmod.io.paths import check_new_dir
from vlmod.models.tiny import FAMILIES, VLM_FAMILIES, build, copy_weights


def add_tiny_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod tiny`: a random tiny LLaVA saved like a hub checkpoint (training from scratch, tests)."""
    p = subparsers.add_parser(
        "tiny",
        help="write a randomly initialised tiny LLaVA model + processor (no download)",
        description="Write a tiny LLaVA-family model with an offline word-level tokenizer and processor: "
        "the starting point of the synthetic recipe.",
    )
    return add_tiny_arguments(p)


def add_tiny_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vlmod tiny`: a randomly initialised tiny model saved like a hub checkpoint,
    the starting point of training from scratch (the synthetic recipe) and of offline tests."""
    parser.add_argument("--out", required=True, help="directory to write the model and processor to")
    parser.add_argument("--family", default="llava", choices=FAMILIES + VLM_FAMILIES)
    parser.add_argument("--width", type=positive_int, default=64, help="language model hidden size")
    parser.add_argument("--layers", type=positive_int, default=4, help="language model layers")
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--mlp-ratio", type=float, default=2.0)
    parser.add_argument("--vision-width", type=positive_int, default=32)
    parser.add_argument("--vision-layers", type=positive_int, default=2)
    parser.add_argument("--image-size", type=positive_int, default=32)
    parser.add_argument("--patch-size", type=positive_int, default=8)
    parser.add_argument("--vision-feature-layer", type=int, default=None,
                        help="tower layer feeding the projector (default: the family's, -2 for CLIP, -1 for SigLIP)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-from", default=None, metavar="DIR",
                        help="start from the weights of this checkpoint of the same sizes (e.g. a trained LLaVA "
                             "into a LLaVA-NeXT-Video: the video recipe's image stage; default: random)")
    parser.set_defaults(run=run_tiny)
    return parser


def run_tiny(args: argparse.Namespace) -> int:
    """Check the sizes, build the model, save it with its processor."""
    if args.width % args.heads or args.heads % args.kv_heads:
        raise InputError(
            f"--width ({args.width}) must be a multiple of --heads ({args.heads}), and --heads of --kv-heads ({args.kv_heads})"
        )
    if args.image_size % args.patch_size:
        raise InputError(f"--image-size ({args.image_size}) must be a multiple of --patch-size ({args.patch_size})")
    if args.vision_width % 4:
        raise InputError(f"--vision-width ({args.vision_width}) must be a multiple of 4 (the tower's heads)")
    out = check_new_dir(args.out, "--out", inputs=[args.init_from])  # a new or empty folder, before any work
    model, processor = build(
        args.family, width=args.width, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        mlp_ratio=args.mlp_ratio, vision_width=args.vision_width, vision_layers=args.vision_layers,
        image_size=args.image_size, patch_size=args.patch_size, vision_feature_layer=args.vision_feature_layer,
        seed=args.seed,
    )
    if args.init_from is not None:
        from vlmod.io.hf import load_pretrained

        copy_weights(load_pretrained(args.init_from), model)
    from safetensors import SafetensorError

    try:
        save_pretrained_atomic(model, processor, out)  # an existing out is empty (checked above)
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise InputError(f"could not write --out {out}: {reason}; nothing was written (free space or choose "
                         "another --out)") from None
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote a tiny {args.family} model ({params / 1e6:.2f} M parameters) to {out}")
    return 0


__all__ = ["add_tiny_arguments", "add_tiny_parser", "run_tiny"]
