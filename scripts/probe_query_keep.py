#!/usr/bin/env python
"""Could a pre-LLM keep that reads the question hold 8x where a question-blind one cannot?

On the crowded fine-detail page a 3x reduction must drop or merge glyphs, and one that has not
read the question (deviation, merging) cannot know which glyph is asked. This probe fits
`vlmod.tools.query_keep.QueryScorer` (each projected vision token against the mean embedding of
the prompt's text tokens, rank `--rank`) to what the fine-tuned MoD model's routed layers run when
every token enters (`fit_query_scorer`, on training pictures: no answer box is read), then scores it on the
validation pictures: how often the asked glyph's patches are among the kept ones (recall, read
from the records' `answer_patches`), and the accuracy of `--model` behind that keep at the
recipe's point (`--keep`, `--capacity`) against the same model behind the recipe's own keep.

    python scripts/probe_query_keep.py runs/crowded/seed-0 --keep 0.285 --capacity 0.146
"""

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmod.cli.argtypes import HelpFormatter


def recall(scores: Tensor, records: list, keep: float) -> float:
    """The share of the asked glyph's patches among each picture's top `keep` by `scores`."""
    k = math.ceil(keep * scores.shape[1])
    top = scores.topk(k, dim=1).indices
    hit = total = 0
    for row, r in zip(top.tolist(), records, strict=True):
        patches = set(r["meta"]["answer_patches"])
        hit += len(patches & set(row))
        total += len(patches)
    return hit / total


def train_behind(scorer: nn.Module, run: Path, args: argparse.Namespace) -> None:
    """The recipe again in a copy of `run` (its dense and MoD stages kept), its stacked stage
    trained and evaluated behind the scorer's keep: the stack's deviation ranking, with no pooling,
    merging or contextual tokens (no baseline uses that combination), ranks by the scorer instead.
    Only the stacked rows of that run's table are the scorer's."""
    import shutil

    from vlmod.cli import main as cli
    from vlmod.tools.reduction import PreLLMReduction

    out = Path(args.train_out)
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("stack", ".vlmod-lock*"))
    ranked = PreLLMReduction._ranked_media

    def by_scorer(self: PreLLMReduction, inputs: Any) -> tuple[Tensor, Tensor, int]:
        features, scores, token_id = ranked(self, inputs)
        if self.scoring != "deviation" or self.pool > 1 or self.merge or self.contextual > 0:
            return features, scores, token_id
        self.scorer = scorer
        return features, self._query_scores(features, inputs, token_id), token_id

    PreLLMReduction._ranked_media = by_scorer
    settings = json.loads((run / "results.json").read_text())["settings"]
    argv = ["recipe", "--task", "detail", "--layout", settings["layout"], "--seed", str(settings["seed"]),
            "--reuse-dense", "--reuse-trained", "mod", "--no-stack-merge", "--stack-pool", "1", "--stack-scoring", "deviation",
            "--stack-share", "8=0.6", "--stack-train-share", "8=0.5", "--threads", str(args.threads), "--no-progress",
            "--out", str(out)] + (["--quick"] if args.quick else [])
    print("vlmod " + " ".join(argv), flush=True)
    raise SystemExit(cli(argv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("run", help="a fine-detail recipe's folder (its data/, mod/model, stack/model)")
    parser.add_argument("--keep", type=float, default=0.285, help="the vision tokens kept (default: 0.285, crowded 8x)")
    parser.add_argument("--capacity", type=float, default=0.146, help="the MoD layers' capacity behind the keep "
                        "(default: 0.146, crowded 8x)")
    parser.add_argument("--model", default="stack", help="which run's model to evaluate behind the keep (default: stack)")
    parser.add_argument("--fit-samples", type=int, default=2000, help="training pictures for the targets (default: 2000)")
    parser.add_argument("--num-samples", type=int, default=400, help="validation pictures scored (default: 400)")
    parser.add_argument("--rank", type=int, default=32, help="the scorer's bilinear rank (default: 32)")
    parser.add_argument("--steps", type=int, default=1500, help="the scorer's fitting steps (default: 1500)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows a batch, fitting and evaluating (default: 16)")
    parser.add_argument("--train-out", default=None, help="instead of the evaluations: a copy of the run (made here) "
                        "whose recipe trains its stacked stage again behind the scorer's keep, dropping the rest "
                        "(default: none)")
    parser.add_argument("--threads", type=int, default=1, help="with --train-out: the recipe's threads (default: 1)")
    parser.add_argument("--quick", action="store_true", help="with --train-out: the run was the recipe's --quick")
    parser.add_argument("--json", default=None, help="write the figures here too (default: none)")
    args = parser.parse_args()
    if not 0.0 < args.keep <= 1.0 or not 0.0 < args.capacity <= 1.0:
        parser.error("--keep and --capacity are shares of the vision tokens, in (0, 1]")
    needs = [Path(args.run) / p for p in ("data/train.json", "data/val.json", "mod/model", f"{args.model}/model",
                                          "results.json")]
    if any(not p.exists() for p in needs):
        parser.error(f"{args.run} is not a finished fine-detail recipe run (no {next(p for p in needs if not p.exists())})")
    if args.train_out and Path(args.train_out).exists():
        parser.error(f"--train-out {args.train_out} exists; give a new folder")

    from transformers import AutoProcessor

    import vlmod
    from vlmod.data.dataset import LlavaDataset
    from vlmod.data.llava_format import load_records
    from vlmod.evaluation.evaluate import evaluate
    from vlmod.tools.query_keep import fit_query_scorer, routed_dataset
    from vlmod.tools.reduction import PreLLMReduction, reduction_flops

    torch.manual_seed(0)
    run = Path(args.run)
    data = run / "data"
    processor = AutoProcessor.from_pretrained(run / "mod" / "model")
    mod = vlmod.load_pretrained(run / "mod" / "model").eval()
    train = LlavaDataset(load_records(data / "train.json")[:args.fit_samples], processor, data)
    started = time.time()
    scorer = fit_query_scorer(mod, train, samples=len(train), steps=args.steps, rank=args.rank,
                              batch_size=args.batch_size, seed=0)
    print(f"scorer fitted on {len(train)} pictures in {time.time() - started:.0f} s")

    raw = json.loads((data / "val.json").read_text())[:args.num_samples]
    val = LlavaDataset(load_records(data / "val.json")[:args.num_samples], processor, data)
    v_vis, v_q, v_target = routed_dataset(mod, val, len(val), args.batch_size, progress=False)
    with torch.no_grad():
        learned = scorer(v_vis, v_q)
    deviation = (v_vis - v_vis.mean(1, keepdim=True)).norm(dim=-1)
    recalls = {"query scorer": recall(learned, raw, args.keep), "its target (the MoD layers, every token in)":
               recall(v_target + 1e-3 * deviation, raw, args.keep), "deviation": recall(deviation, raw, args.keep)}
    print(f"\n| ranking | the asked glyph's patches in the top {args.keep:g} |\n|---|---|")
    for name, value in recalls.items():
        print(f"| {name} | {100 * value:.1f}% |")

    # Each picture's answer patches by its pixels (evaluate runs each batch twice: forward, generate).
    answers = {round(val[i]["pixel_values"].double().sum().item(), 2): r["meta"]["answer_patches"]
               for i, r in enumerate(raw)}

    class OracleKeep(PreLLMReduction):
        """The asked glyph's patches first, then the scorer's ranking: what a keep that never
        misses the answer would score."""

        def _ranked_media(self, inputs: Any) -> tuple[Tensor, Tensor, int]:
            features, scores, token_id = super()._ranked_media(inputs)
            scores = torch.sigmoid(scores).view(inputs["input_ids"].shape[0], -1)
            for row, pixels in enumerate(inputs["pixel_values"]):
                scores[row, answers[round(pixels.double().sum().item(), 2)]] += 10.0
            return features, scores.reshape(-1), token_id

    if args.train_out:
        train_behind(scorer, run, args)
        return
    model = vlmod.load_pretrained(run / args.model / "model").eval()
    vlmod.set_capacity(model, args.capacity)
    settings = json.loads((run / "results.json").read_text())["settings"]
    merge = bool(settings.get("stack_merge"))
    rows = {}
    for name, reducer in (("query scorer", PreLLMReduction(model, args.keep, "query", scorer=scorer)),
                          ("the answer's patches, then the scorer", OracleKeep(model, args.keep, "query", scorer=scorer)),
                          ("the recipe's keep (" + ("merging" if merge else settings["stack_scoring"]) + ")",
                           PreLLMReduction(model, args.keep, settings["stack_scoring"], merge=merge))):
        report = evaluate(reducer, processor, val, batch_size=args.batch_size, max_new_tokens=4, progress=False,
                          name=name, flops_fn=reduction_flops)
        rows[name] = {"accuracy": report.accuracy, "language_gflops": report.flops_by_part["language"] / 1e9}
    print(f"\n| {args.model} behind | accuracy (first {len(val)}) | LM GFLOPs |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {100 * row['accuracy']:.1f}% | {row['language_gflops']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"recall": recalls, "accuracy": rows}, indent=1))


if __name__ == "__main__":
    main()
