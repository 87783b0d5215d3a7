"""The synthetic recipes: vlmod's offline, end-to-end quality check on a CPU, for images and video.

`--task image`: a tiny LLaVA on the synthetic shapes set; `--task video`: a tiny
LLaVA-NeXT-Video on synthetic clips through the real video path (the processor's video inputs,
`pixel_values_videos`, video tokens routable), 8 frames a clip, with questions most of which
need several frames (`vlmod.data.synthetic_video`).

1. generate the data; 2. train the model dense from scratch (tower included; `tower_steps`: the
tower first learns what each image patch shows, `vlmod.tower_pretrain`; video: first a LLaVA of
the same sizes on image questions, whose weights the video model starts from; `refine_steps`: a
second dense stage, the tower frozen, distilling the first dense model); 3. rank its
language layers (ARank, reported; the converted layers are every layer but layer 0 unless
`mod_layers="arank:N"`); 4. solve the compute points: for each target reduction of language-model
prefill FLOPs, the MoD capacity, the kept fraction of a pre-LLM reduction and (video) the
number of frames that reach it (`vlmod.frontier`); 5. convert; 6. fine-tune one MoD model with
its capacity drawn per step from the compute points' capacities (one model, every point),
distilling the dense model's answer distribution (`vlmod.distill`);
7. evaluate dense, the fine-tuned MoD model at every point, and at the same points: the random
and stride routers on its weights, the training-free attention router on the dense weights,
pre-LLM reduction and frame subsampling of the dense model, and at the main point the MoD model
with the vision tower routed too (`dense_control`: also the dense model fine-tuned again exactly
as the MoD stage, unconverted: what the MoD model's extra training alone gives); 8. write
results.json, results.md and frontier.png.

Every stage is a public vlmod function (`vlmod tiny`, `finetune`, `rank`, `convert`, `eval`,
`vlmod.reduction`), so the recipe is also a worked example of the workflow.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmod.bench.timing import keeps_threads
from vlmod.errors import InputError
from vlmod.fileio import save_pretrained_atomic, write_json, write_text
from vlmod.recipe_reuse import (
    CONTROL_STAGES,
    DENSE_RUN,
    REFINED_RUN,
    reusable_dense,
    reusable_finetune,
    reusable_refined,
)
from vlmod.reduction import SCORINGS

TASKS = ("image", "video")
VIDEO_POOLS = ("average", "max", "conv")


@dataclass
class RecipeSettings:
    """Everything a recipe depends on; `for_task` gives the README's runs."""

    task: str = "image"
    num_train: int = 16000
    num_val: int = 2400
    baseline_samples: int | None = 400
    image_size: int = 32
    frames: int = 8
    video_pool: str = "average"
    distractors: int = 0
    captions: bool = False
    width: int = 128
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    vision_width: int = 128
    vision_layers: int = 2
    patch_size: int = 4
    tower_steps: int = 0
    dense_steps: int = 2500
    refine_steps: int = 0
    image_steps: int = 0
    num_train_images: int = 0
    image_batch_size: int = 32
    image_model: str | None = None
    dense_lr: float = 1e-3
    weight_decay: float = 0.05
    batch_size: int = 32
    mod_layers: str = "all"
    schedule: str | None = None
    targets: tuple[float, ...] = (1.5, 2.0, 3.0, 3.5)
    goal: float = 3.0
    rank_samples: int = 64
    mod_steps: int = 2100
    mod_lr: float = 5e-4
    capacity_warmup: float = 0.0
    router_lr: float = 5e-3
    routers: tuple[str, ...] = ("random", "stride", "attention")
    vision_capacity: float = 0.5
    distill: bool = True
    dense_control: bool = False
    eval_batch_size: int = 32
    seed: int = 0
    threads: int | None = None

    @classmethod
    def for_task(cls, task: str, quick: bool = False, **overrides: Any) -> RecipeSettings:
        """The defaults of `task` ("image" or "video"); `quick`: toy sizes that run the whole
        pipeline in well under two minutes (for tests; its accuracies mean nothing)."""
        if task not in TASKS:
            raise InputError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
        base: dict[str, Any] = {"task": task}
        if task == "video":
            base.update(num_train=8000, num_val=2520, baseline_samples=420, batch_size=16, eval_batch_size=16, captions=True,
                        image_steps=2000, num_train_images=8000, dense_steps=2000, mod_steps=1500, mod_lr=1e-3,
                        tower_steps=1500, refine_steps=1500)
        if quick:
            base.update(
                num_train=32 if task == "image" else 28, num_val=8 if task == "image" else 14, width=64, layers=4,
                vision_width=32, patch_size=8, dense_steps=3, mod_steps=2, rank_samples=4, batch_size=8,
                frames=4, eval_batch_size=16, targets=(1.5, 3.0),
            )
            base.update(baseline_samples=6 if task == "image" else 5)
            if task == "video":
                base.update(image_steps=2, num_train_images=16, tower_steps=2, refine_steps=2)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not self.targets or any(t <= 1.0 for t in self.targets):
            raise InputError(f"targets are LM FLOPs reductions > 1 (e.g. 2 for half the FLOPs), got {self.targets}")
        if self.task == "video" and self.tower_steps and not (self.num_train_images or self.image_model):
            raise InputError("tower pretraining learns on the image set: give num_train_images > 0 or tower_steps 0")
        if self.video_pool not in VIDEO_POOLS:
            raise InputError(f"video_pool must be one of {', '.join(VIDEO_POOLS)}, got {self.video_pool!r}")
        self.targets = tuple(sorted(float(t) for t in self.targets))
        self.routers = tuple(self.routers)

    @property
    def family(self) -> str:
        return "llava" if self.task == "image" else "llava_next_video"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"], d["routers"] = list(self.targets), list(self.routers)
        return d


@dataclass
class RecipeResult:
    settings: RecipeSettings
    rows: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    layers: list[int] = field(default_factory=list)
    ranks: list[float] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)

    def row(self, method: str, target: float | None = None) -> dict[str, Any]:
        return next(r for r in self.rows if r["method"] == method and r["target"] == target)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.to_dict(),
            "converted_layers": self.layers,
            "normalized_ranks": self.ranks,
            "compute_points": self.points,
            "results": self.rows,
            "stage_seconds": self.stages,
            "total_seconds": sum(self.stages.values()),
            "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        }


class _Stages:
    """Times each stage and prints it as it ends."""

    def __init__(self, result: RecipeResult, log: Callable[[str], None]) -> None:
        self.result, self.log = result, log

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        self.log(f"== {name}")
        start = time.perf_counter()
        value = fn()
        self.result.stages[name] = self.result.stages.get(name, 0.0) + time.perf_counter() - start
        self.log(f"   {name}: {time.perf_counter() - start:.0f} s")
        return value


def token_counts(processor: Any, data: Path, s: RecipeSettings, limit: int = 64) -> Any:
    """Mean text and vision tokens of the eval prompts (the first `limit`)."""
    from vlmod.data import LlavaDataset, load_records
    from vlmod.frontier import TokenCounts

    records = load_records(data)[:limit]
    ds = LlavaDataset(records, processor, data.parent, num_frames=s.frames)
    tok = processor.tokenizer
    media = tok.convert_tokens_to_ids("<video>" if s.task == "video" else "<image>")
    text = vision = 0.0
    for i in range(len(ds.records)):
        inputs = ds.prompt_inputs(i).inputs
        n_vision = int((inputs["input_ids"] == media).sum())
        vision += n_vision
        text += int(inputs["attention_mask"].sum()) - n_vision
    n = len(ds.records)
    return TokenCounts(text=text / n, vision=vision / n, frames=s.frames if s.task == "video" else 1)


@keeps_threads  # --threads applies to the recipe, not to what runs after it in the process
def run_recipe(out: str | Path, settings: RecipeSettings | None = None, progress: bool = True,
               log: Callable[[str], None] = print, reuse_dense: bool = False,
               reuse_trained: bool = False) -> RecipeResult:
    """Run every stage into `out` (see the module doc) and write results.json / results.md /
    frontier.png. reuse_dense: keep the dense model of an earlier run in `out` trained with the
    same settings (its training time is taken from that run's record); reuse_trained: keep its
    MoD fine-tune and control too (the same settings), so only the evaluations run again."""
    from transformers import AutoProcessor

    from vlmod import frontier, tiny
    from vlmod.config import MoDConfig
    from vlmod.convert import ConvertOptions, convert
    from vlmod.data.synthetic import generate
    from vlmod.eval import evaluate
    from vlmod.flops import DecoderDims, attention_router_flops
    from vlmod.hf import load_pretrained
    from vlmod.rank_cli import rank_checkpoint
    from vlmod.reduction import PreLLMReduction, reduction_flops
    from vlmod.routing.api import apply_mod, set_capacity, set_router
    from vlmod.tower_pretrain import pretrain_tower
    from vlmod.train import TrainConfig, train

    s = settings or RecipeSettings()
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    result = RecipeResult(settings=s)
    stages = _Stages(result, log)
    data = out / "data"
    video = s.task == "video"
    train_json = data / ("video_train.json" if video else "train.json")
    val_json = data / ("video_val.json" if video else "val.json")

    def make_data() -> None:
        if video:  # the images feed the image stage only
            generate(data, 0 if s.image_model else s.num_train_images, 0, image_size=s.image_size, distractors=s.distractors, seed=s.seed,
                     captions=s.captions, video=True, num_videos=s.num_train, num_val_videos=s.num_val, num_frames=s.frames,
                     progress=progress)
        else:
            generate(data, s.num_train, s.num_val, image_size=s.image_size, distractors=s.distractors, seed=s.seed,
                     captions=s.captions, progress=progress)

    def build(family: str) -> tuple[Any, Any]:
        return tiny.build(
            family, width=s.width, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, vision_width=s.vision_width,
            vision_layers=s.vision_layers, image_size=s.image_size, patch_size=s.patch_size,
            vision_feature_layer=-1, spatial_pool_mode=s.video_pool, seed=s.seed,
        )

    def init() -> None:
        image_stage = s.image_steps and not s.image_model
        for family, folder in [(s.family, "init")] + ([("llava", "image-init")] if image_stage else []):
            save_pretrained_atomic(*build(family), out / folder)

    trained: dict[str, float] = {}  # --reuse-trained: the earlier run's training seconds per run

    def finetune(model: Path, run: str, data_json: Path = train_json, batch_size: int = s.batch_size,
                 **kw: Any) -> Path:
        cfg = TrainConfig(
            model=str(model), data=str(data_json), output_dir=str(out / run), batch_size=batch_size,
            cache_data=True, seed=s.seed, log_steps=25, warmup=0.05, num_frames=s.frames, overwrite=True, **kw,
        )
        if reuse_trained and run in ("mod", "dense-control"):
            model_dir, trained[run] = reusable_finetune(out, cfg)
            return model_dir
        return train(cfg, progress=progress).model_dir

    def pretrain(first: Path) -> Path:
        """The tower learns what each patch of the training images shows before any language
        training, as LLaVA's starts from a pretrained CLIP (`vlmod.tower_pretrain`)."""
        pretrain_tower(first, data / "train.json", out / "tower", steps=s.tower_steps, seed=s.seed, progress=progress)
        return out / "tower" / "model"

    def train_on_images(first: Path) -> Path:
        """The image stage: a LLaVA of the same sizes learns to see on the image questions, then
        the video model starts from its weights (as LLaVA-NeXT-Video starts from LLaVA-NeXT):
        from scratch, the video model never learned colour, shape or position (39.8% after 3000 steps)."""
        if s.image_model:  # an image LLaVA of the same sizes trained elsewhere (the image recipe's dense model)
            images = Path(s.image_model).expanduser()
        else:
            images = finetune(first, "image", data / "train.json", s.image_batch_size, trainable="full",
                              train_vision_tower=True, lr=s.dense_lr, max_steps=s.image_steps,
                              weight_decay=s.weight_decay)
        model = load_pretrained(out / "init")
        tiny.copy_weights(load_pretrained(images), model)
        save_pretrained_atomic(model, AutoProcessor.from_pretrained(out / "init"), out / "init-images")
        return out / "init-images"

    first_dense = out / DENSE_RUN / "model"
    dense = out / REFINED_RUN / "model" if s.refine_steps else first_dense  # what every later stage starts from

    def refine() -> None:
        """The second dense stage: the tower frozen, the language model and projector go on at the
        dense learning rate from a fresh warm-up, distilling the first dense model's answers (a
        born-again student). Seed 0's first model answered "when" 70.6%, refined 87.8%."""
        finetune(first_dense, REFINED_RUN, trainable="language", lr=s.dense_lr, max_steps=s.refine_steps,
                 distill_from=str(first_dense))

    def record(run: str) -> None:
        write_json(out / run / "recipe.json", {"settings": s.to_dict(), "stage_seconds": dict(result.stages)})

    def refine_and_record() -> None:
        stages.run("refine dense", refine)
        record(REFINED_RUN)  # after the stage, so its record holds the refinement's own time

    if reuse_trained and not reuse_dense:
        raise InputError("--reuse-trained goes with --reuse-dense (the fine-tunes start from that dense model)")
    if reuse_dense:
        result.stages.update(reusable_dense(out, s))
        log(f"== reusing the dense model in {first_dense} (trained in {result.stages['train dense']:.0f} s)")
        if not val_json.is_file() or len(json.loads(val_json.read_text())) != s.num_val:
            stages.run("data", make_data)  # another validation size; the same seed writes the same training set
        if s.refine_steps:
            refined = reusable_refined(out, s)
            if refined is None and reuse_trained:
                raise InputError(f"--reuse-trained: the refined dense model in {out} is missing or was refined with "
                                 "other settings, so the fine-tunes from it must train again: drop --reuse-trained")
            if refined is None:
                refine_and_record()
            else:
                result.stages["refine dense"] = refined["refine dense"]
                log(f"== reusing the refined dense model in {dense} (refined in {refined['refine dense']:.0f} s)")
    else:
        stages.run("data", make_data)
        stages.run("init", init)
        first = out / ("image-init" if video and s.image_steps else "init")
        if s.tower_steps and not s.image_model:
            first = stages.run("pretrain tower", lambda: pretrain(first))
        start = stages.run("train on images", lambda: train_on_images(first)) if s.image_steps or s.image_model else first
        stages.run("train dense", lambda: finetune(
            start, DENSE_RUN, trainable="full", train_vision_tower=True, lr=s.dense_lr, max_steps=s.dense_steps,
            weight_decay=s.weight_decay,
        ))
        record(DENSE_RUN)
        if s.refine_steps:
            refine_and_record()

    processor = AutoProcessor.from_pretrained(dense)
    dims = DecoderDims.from_config(load_pretrained(dense).config.text_config)

    def evaluated(model: Any, name: str, baseline: bool = False, **kw: Any) -> Any:
        """`baseline`: one of the other methods, on the first `baseline_samples` questions."""
        report = evaluate(model, processor, val_json, batch_size=s.eval_batch_size, max_new_tokens=4,
                          progress=progress, name=name, num_frames=kw.pop("num_frames", s.frames),
                          limit=s.baseline_samples if baseline else None, **kw)
        log(f"   {name}: accuracy {100 * report.accuracy:.1f}%, answer loss {report.answer_loss:.3f}, "
            f"LM GFLOPs {report.flops_by_part['language'] / 1e9:.4f}")
        return report

    dense_model = load_pretrained(dense).eval()
    dense_report = stages.run("eval dense", lambda: evaluated(dense_model, "dense"))
    result.rows.append(frontier.row("dense", None, f"refined +{s.refine_steps} steps" if s.refine_steps else "-", dense_report))
    # Frame subsampling's FLOPs reference: the dense model on every frame of the questions it answers.
    frames_reference = dense_report
    if video and s.baseline_samples and s.baseline_samples < len(dense_report.samples):
        frames_reference = stages.run("eval dense", lambda: evaluated(dense_model, "dense, the first questions", baseline=True))

    def rank() -> list[int]:
        ranks = rank_checkpoint(str(dense), train_json, num_samples=s.rank_samples, batch_size=8, progress=progress)
        result.ranks = list(ranks.normalized)
        if s.mod_layers.startswith("arank:"):
            chosen = sorted(ranks.select(int(s.mod_layers.split(":", 1)[1])))
        else:
            chosen = list(range(1, s.layers))
        ranks.suggested = chosen
        write_json(out / "ranks.json", ranks.to_dict())
        log(f"   ARank normalised ranks {[round(r, 3) for r in ranks.normalized]}; converted layers {chosen}")
        return chosen

    result.layers = layers = stages.run("rank", rank)
    counts = token_counts(processor, val_json, s)
    scoring = attention_router_flops(dims, counts.total, counts.text)  # per MoD layer
    for t in s.targets:
        point = {
            "target": t,
            "capacity": frontier.solve_capacity(dims, counts, t, layers, s.schedule),
            "attention_capacity": frontier.solve_capacity(dims, counts, t, layers, s.schedule, scoring),
            "keep": frontier.solve_keep(dims, counts, t),
        }
        if video:
            point["frames"] = frontier.solve_frames(dims, counts, t)
        result.points.append(point)
    log(f"   tokens per sample: text {counts.text:.1f}, vision {counts.vision:.1f}; compute points {result.points}")

    converted = out / "converted"
    routable = ["video"] if video else ["image"]
    main = min(result.points, key=lambda p: abs(p["target"] - s.goal))
    stages.run("convert", lambda: convert(ConvertOptions(
        model=str(dense), out=str(converted), capacity=main["capacity"], layers=layers, routable=routable,
        capacity_schedule=s.schedule, overwrite=True,
    )))
    # The MoD stage's training; the control repeats it on the unconverted dense model.
    mod_stage = {"trainable": "language", "lr": s.mod_lr, "max_steps": s.mod_steps,
                 "distill_from": str(dense) if s.distill else None}
    mod = stages.run("train MoD", lambda: finetune(
        converted, "mod", router_lr=s.router_lr, capacities=[p["capacity"] for p in result.points],
        capacity_warmup=s.capacity_warmup, **mod_stage,
    ))
    if s.dense_control:
        control = stages.run(CONTROL_STAGES[0], lambda: finetune(dense, "dense-control", **mod_stage))
    for run, stage in (("mod", "train MoD"), ("dense-control", CONTROL_STAGES[0])):
        if run in trained:
            result.stages[stage] = trained[run]
            log(f"   {stage}: reused the earlier run's model (trained in {trained[run]:.0f} s)")
    if s.dense_control:
        report = stages.run(CONTROL_STAGES[1], lambda: evaluated(load_pretrained(control).eval(), "dense control"))
        result.rows.append(frontier.row("dense-control", None, f"+{s.mod_steps} steps as the MoD stage", report))
    mod_model = load_pretrained(mod).eval()
    attention_model = load_pretrained(converted).eval()
    set_router(attention_model, "attention")

    for p in result.points:
        t, cap = p["target"], p["capacity"]
        set_capacity(mod_model, cap)
        setting = f"capacity {cap:.3f}"
        with_router = [("learned", None)] + [(r, r) for r in s.routers if r != "attention"]
        for method, router in with_router:
            def run_mod(router: str | None = router, name: str = f"{method} /{t:g}") -> Any:
                if router is None:
                    return evaluated(mod_model, name)
                set_router(mod_model, router)
                try:
                    return evaluated(mod_model, name, baseline=True)
                finally:
                    set_router(mod_model, "learned")
            result.rows.append(frontier.row(method, t, setting, stages.run(f"eval {method}", run_mod)))
        if "attention" in s.routers:
            # Its scoring costs FLOPs too: a lower capacity reaches the same total.
            set_capacity(attention_model, p["attention_capacity"])
            report = stages.run("eval attention", lambda n=f"attention /{t:g}": evaluated(attention_model, n, baseline=True))
            result.rows.append(frontier.row("attention", t, f"capacity {p['attention_capacity']:.3f}", report,
                                            len(layers) * scoring))
        # Both of VisionZip's rankings: these towers are trained from scratch under LLaVA, which reads
        # only the patches, so nothing trains their CLS; which ranking is the stronger varies by model.
        for rank_by, method in zip(SCORINGS, ("reduce", "reduce-mean"), strict=True):
            reducer = PreLLMReduction(dense_model, p["keep"], rank_by)
            report = stages.run("eval reduce", lambda r=reducer, n=f"{method} /{t:g}": evaluated(
                r, n, baseline=True, flops_fn=reduction_flops))
            report.processed_fraction = {"kept": p["keep"]}
            result.rows.append(frontier.row(method, t, f"keep {p['keep']:.3f}", report))
        if video:
            f = p["frames"]
            report = stages.run("eval frames", lambda f=f: evaluated(dense_model, f"frames {f}", baseline=True, num_frames=f))
            report.processed_fraction = {"frames": f / s.frames}
            # Against the dense model on every frame, not the report's own dense count on fewer.
            result.rows.append(frontier.row("frames", t, f"{f} of {s.frames} frames", report,
                                            dense_language=frames_reference.flops_by_part["language"]))

    # The main point again with the vision tower routed too (training-free, CLS attention).
    set_capacity(mod_model, main["capacity"])
    tower = MoDConfig(capacity=s.vision_capacity, layers=[s.vision_layers - 1], routable=("image",), router="attention")
    apply_mod(mod_model, tower, part="vision")
    report = stages.run("eval vision MoD", lambda: evaluated(mod_model, "learned + vision tower", baseline=True))
    report.processed_fraction = {k: v for k, v in report.processed_fraction.items() if k.startswith("language")}
    result.rows.append(frontier.row("learned+vision", main["target"],
                                    f"capacity {main['capacity']:.3f}, tower {s.vision_capacity:g}", report))

    write_json(out / "results.json", result.to_dict())
    table = format_results(result)
    write_text(out / "results.md", table + "\n")
    frontier.plot_frontier(result.rows, out / "frontier.png", f"synthetic {s.task} recipe: accuracy against compute")
    log(table)
    return result


def format_results(result: RecipeResult) -> str:
    """results.md: the frontier table, the verdicts and the stage times."""
    from vlmod.data.synthetic_video import TEMPORAL_TYPES
    from vlmod.frontier import format_frontier, verdicts

    s = result.settings
    temporal = TEMPORAL_TYPES if s.task == "video" else ()
    lines = [format_frontier(result.rows, temporal), ""]
    if temporal:
        lines += ["(* needs several frames)", ""]
    lines.append(f"- converted language layers {result.layers} of {s.layers}; ARank normalised ranks "
                 f"{[round(r, 3) for r in result.ranks]}")
    dense = result.row("dense")
    if s.baseline_samples and s.baseline_samples < dense["samples"]:
        lines.append(f"- questions: dense, the control and MoD answered all {dense['samples']} validation "
                     f"questions, the other methods the first {s.baseline_samples} (each compared with MoD on those)")
    lines += [f"- {v}" for v in verdicts(result.rows, s.goal)]
    aim = "aim >= 90%" + (", >= 85% on each type that needs several frames" if temporal else "")
    lines.append(f"- dense accuracy {100 * dense['accuracy']:.1f}% ({aim}), by type "
                 + ", ".join(f"{t} {100 * a:.1f}%" for t, a in sorted(dense["accuracy_by_type"].items())))
    total = sum(result.stages.values())
    control = sum(result.stages.get(k, 0.0) for k in CONTROL_STAGES)
    lines.append(f"- whole recipe: {total / 60:.1f} min"
                 + (f" ({(total - control) / 60:.1f} min without the control)" if control else "") + " ("
                 + ", ".join(f"{k} {v:.0f} s" for k, v in result.stages.items()) + ")")
    return "\n".join(lines)


__all__ = ["TASKS", "RecipeResult", "RecipeSettings", "format_results", "run_recipe", "token_counts"]
