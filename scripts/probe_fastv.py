#!/usr/bin/env python
"""FastV's rule against the recipe's attention router, on one dense model: both rank vision tokens
by the attention the prompt pays them, but "fastv" ranks once, at the first MoD layer, and every
later layer runs the same tokens (a token dropped there stays dropped, as FastV prunes), where
"attention" ranks again at every layer. Both on the dense weights converted at every language layer
but layer 0 (as the recipe converts), at each capacity, on the first questions of a validation set;
a table, and with --json the accuracies.

    python scripts/probe_fastv.py vlmod/demo/assets/dense --data runs/video-val-seed1/video_val.json \\
        --capacities 0.164 0.211
"""

import argparse
import json
import time
from pathlib import Path

import torch

from vlmod.cli.argtypes import HelpFormatter, positive_int, threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("model", help="a dense LLaVA-family checkpoint (a recipe's dense/model)")
    parser.add_argument("--data", required=True, help="LLaVA-format validation JSON, its media beside it (no default)")
    parser.add_argument("--num-samples", type=positive_int, default=420, help="questions, the first ones (default: 420)")
    parser.add_argument("--capacities", type=float, nargs="+", default=[0.164],
                        help="MoD capacities to run both routers at (default: 0.164, the video recipe's 3x point "
                             "for the attention router)")
    parser.add_argument("--routable", default=None, help="the routable token type (default: video for a video "
                        "model, else image)")
    parser.add_argument("--frames", type=positive_int, default=8, help="frames a clip (default: 8)")
    parser.add_argument("--threads", type=threads, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the accuracies here (default: none)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoProcessor

    import vlmod
    from vlmod.data.dataset import LlavaDataset
    from vlmod.data.llava_format import load_records
    from vlmod.evaluation.evaluate import evaluate
    from vlmod.io.hf import load_pretrained

    data_json = Path(args.data)
    processor = AutoProcessor.from_pretrained(args.model)
    data = LlavaDataset(load_records(data_json)[:args.num_samples], processor, data_json.parent,
                        num_frames=args.frames, cache=True)
    dense = load_pretrained(args.model).eval()
    routable = args.routable or ("video" if "video" in type(dense).__name__.lower() else "image")
    layers = list(range(1, dense.config.text_config.num_hidden_layers))

    def accuracy(model: torch.nn.Module, name: str) -> float:
        report = evaluate(model, processor, data, batch_size=16, max_new_tokens=4, progress=False, name=name,
                          limit=args.num_samples)
        return 100 * report.accuracy

    start = time.perf_counter()
    rows = {"dense": accuracy(dense, "dense")}
    for router in ("attention", "fastv"):
        model = vlmod.apply_mod(load_pretrained(args.model).eval(),
                                vlmod.MoDConfig(capacity=1.0, layers=layers, routable=(routable,), router=router))
        for capacity in args.capacities:
            vlmod.set_capacity(model, capacity)
            rows[f"{router} {capacity:g}"] = accuracy(model, f"{router} {capacity:g}")
    print(f"{len(data)} questions, {time.perf_counter() - start:.0f} s; dense {rows['dense']:.1f}%")
    print("| capacity | attention router (ranks at every layer) | FastV's rule (ranks once) |\n|---|---|---|")
    for capacity in args.capacities:
        print(f"| {capacity:g} | {rows[f'attention {capacity:g}']:.1f}% | {rows[f'fastv {capacity:g}']:.1f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps({"questions": len(data), "accuracy": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
