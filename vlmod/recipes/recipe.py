"""The synthetic recipes: vlmod's offline, end-to-end quality check on a CPU, for images and video.

`--task image`: a tiny LLaVA on the synthetic shapes set; `--task video`: a tiny
LLaVA-NeXT-Video on synthetic clips through the real video path (the processor's video inputs,
`pixel_values_videos`, video tokens routable), 8 frames a clip, with questions most of which
need several frames (`vlmod.data.synthetic_video`); `--task detail`: the image task's stages on the
fine-detail set, whose answers rest on at most 5% of the vision tokens (`vlmod.data.detail`).

1. generate the data; 2. train the model dense from scratch (tower included; `tower_steps`: the
tower first learns what each image patch shows, `vlmod.training.tower_pretrain`; video: first a LLaVA of
the same sizes on image questions, whose weights the video model starts from; `refine_steps`: a
second dense stage, the tower frozen, distilling the first dense model); 3. rank its
language layers (ARank, reported; the converted layers are every layer but layer 0 unless
`mod_layers="arank:N"`); 4. solve the compute points: for each
target reduction of language-model prefill FLOPs, the MoD capacity, the kept fraction of a pre-LLM
reduction, the kept fraction and capacity of MoD stacked on it and (video) the number of frames
that reach it, or that a method cannot (`vlmod.recipes.points`); 5. convert; 6. fine-tune one MoD model with
its capacity drawn per step from the compute points' capacities (one model, every point),
distilling the dense model's answer distribution (`vlmod.training.distill`), and (`stack_steps`)
that model on for MoD stacked on pre-LLM reduction: behind the reduction, each step at the kept
fraction and capacity of one stacked point past `train_up_to`; 7. evaluate dense, the fine-tuned MoD model at every point, and at the same points: the random
and stride routers on its weights, the training-free attention router on the dense weights,
pre-LLM reduction and frame subsampling of the dense model, the MoD model stacked on pre-LLM
reduction, and at the main point the MoD model with the vision tower routed too
(`vlmod.recipes.methods`; every row counts the language model's prefill FLOPs and the whole
prefill's: tower, projector, language model; `dense_control`: also the dense model fine-tuned
again exactly as the MoD stage, unconverted: what the MoD model's extra training alone gives); 8. write
results.json, results.md and frontier.png.

Every stage is a public vlmod function (`vlmod tiny`, `finetune`, `rank`, `convert`, `eval`,
`vlmod.tools.reduction`), so the recipe is also a worked example of the workflow.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoProcessor

from vlmod.bench.timing import keeps_threads
from vlmod.data import LlavaDataset, load_records
from vlmod.data.detail import generate_detail
from vlmod.data.synthetic import generate
from vlmod.data.synthetic_video import TEMPORAL_TYPES
from vlmod.errors import InputError
from vlmod.evaluation import frontier, knobs
from vlmod.evaluation.evaluate import evaluate
from vlmod.evaluation.set_checks import (
    answer_blanked_report,
    check_recipe_sets,
    format_set_checks,
    one_frame_report,
)
from vlmod.io.files import save_pretrained_atomic, write_json, write_text
from vlmod.io.hf import load_pretrained, max_positions
from vlmod.models import tiny
from vlmod.recipes.cost import format_costs, run_cost
from vlmod.recipes.keep import KEEP_RUN, fit_keep
from vlmod.recipes.methods import PointEvaluations
from vlmod.recipes.points import describe_points, ours, solve_points, stack_training_points
from vlmod.recipes.reuse import (
    CONTROL_STAGES,
    DENSE_RUN,
    FINE_TUNES,
    REFINED_RUN,
    TRAINING_RUNS,
    kept_fine_tunes,
    recipe_folder,
    reusable_dense,
    reusable_finetune,
    reusable_refined,
)
from vlmod.recipes.settings import (
    TASKS,
    VIDEO_POOLS,
    RecipeResult,
    RecipeSettings,
    check_image_model,
    format_machine,
    machine,
)
from vlmod.tools.calibrate import rank_checkpoint
from vlmod.tools.convert import ConvertOptions, convert
from vlmod.tools.flops import DecoderDims
from vlmod.tools.training_flops import projector_flops
from vlmod.training.tower_pretrain import pretrain_tower
from vlmod.training.train import TrainConfig, train


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


def token_counts(dataset: Any, s: RecipeSettings, limit: int = 64) -> Any:
    """Mean text and vision tokens of the eval prompts of `dataset` (a `LlavaDataset`, the first
    `limit` records)."""
    from vlmod.evaluation.knobs import TokenCounts

    records = dataset.records[:limit]
    media = dataset.processor.tokenizer.convert_tokens_to_ids("<video>" if s.task == "video" else "<image>")
    text = vision = 0.0
    for record in records:
        inputs = dataset.eval_inputs(record)[1].inputs
        n_vision = int((inputs["input_ids"] == media).sum())
        vision += n_vision
        text += int(inputs["attention_mask"].sum()) - n_vision
    return TokenCounts(text=text / len(records), vision=vision / len(records), frames=s.frames if s.task == "video" else 1)


@keeps_threads  # --threads applies to the recipe, not to what runs after it in the process
def run_recipe(out: str | Path, settings: RecipeSettings | None = None, progress: bool = True,
               log: Callable[[str], None] = print, reuse_dense: bool = False,
               reuse_trained: bool | str | Sequence[str] = False, overwrite: bool = False) -> RecipeResult:
    """Run every stage into `out` (see the module doc) and write results.json / results.md /
    frontier.png. reuse_dense: keep the dense model of an earlier run in `out` trained with the
    same settings (its training time is taken from that run's record); reuse_trained: keep its
    MoD fine-tune, stacked stage and control too (the same settings), so only the evaluations run
    again, or only those named (`kept_fine_tunes`: "mod" trains the stacked stage again);
    overwrite: train everything again in a folder an earlier recipe run made. `out` must be new,
    empty or a recipe's, and one recipe writes it at a time (`vlmod.recipes.reuse.recipe_folder`)."""
    kept = kept_fine_tunes(reuse_trained, reuse_dense)
    check_image_model(settings or RecipeSettings())  # before anything is made, not after the data stage
    with recipe_folder(out, reuse_dense, overwrite) as folder:
        recipe = _Recipe(folder, settings or RecipeSettings(), progress, log, kept)
        if reuse_dense:
            recipe.reuse_dense()
        else:
            recipe.train_dense()
        recipe.evaluate_dense()
        recipe.result.layers = recipe.stages.run("rank", recipe.rank)
        recipe.solve_points()
        recipe.convert_and_finetune()
        recipe.evaluate_points()
        recipe.evaluate_vision_mod()
        return recipe.write_results()


def trained_capacities(points: list[dict[str, Any]], up_to: float) -> list[float]:
    """The capacities the MoD stage trains at: ours (`mod_capacity`) at the points MoD reaches up
    to `up_to` (the lowest-reduction reachable point's alone when none is that low)."""
    reached = [p for p in points if p["mod_capacity"] is not None]
    return [p["mod_capacity"] for p in reached if p["target"] <= up_to] or [p["mod_capacity"] for p in reached[:1]]


class _Recipe(PointEvaluations):
    """The stages of one recipe run, in the order `run_recipe` calls them; each records what later
    stages read (the dense model, the compute points, the fine-tuned models) on `self`; the
    methods' evaluations are `vlmod.recipes.methods`."""

    def __init__(self, out: Path, s: RecipeSettings, progress: bool, log: Callable[[str], None],
                 reuse_trained: tuple[str, ...]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if s.threads:
            torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        self.out, self.s, self.progress, self.log, self.reuse_trained = out, s, progress, log, reuse_trained
        self.result = RecipeResult(settings=s)
        self.stages = _Stages(self.result, log)
        self.data = out / "data"
        self.video = s.task == "video"
        self.train_json = self.data / ("video_train.json" if self.video else "train.json")
        self.val_json = self.data / ("video_val.json" if self.video else "val.json")
        self.first_dense = out / DENSE_RUN / "model"
        # What every later stage starts from.
        self.dense = out / REFINED_RUN / "model" if s.refine_steps else self.first_dense
        self.trained: dict[str, float] = {}  # --reuse-trained: the earlier run's training seconds per run
        self.val_sets: dict[tuple[int, int | None], Any] = {}  # `val_set`

    # -- the dense model -----------------------------------------------------------------------

    def make_data(self) -> None:
        s = self.s
        if self.video:  # the images feed the image stage only
            generate(self.data, 0 if s.image_model else s.num_train_images, 0, image_size=s.image_size,
                     distractors=s.distractors, seed=s.seed, captions=s.captions, video=True, num_videos=s.num_train,
                     num_val_videos=s.num_val, num_frames=s.frames, progress=self.progress)
        elif s.task == "detail":  # the fine-detail set: the image task's stages on small glyphs and markers
            generate_detail(self.data, s.num_train, s.num_val, image_size=s.image_size, patch_size=s.patch_size,
                            seed=s.seed, captions=s.captions, scale=s.glyph_scale, question_types=s.types,
                            question_first=s.question_first, layout=s.layout, faint=s.faint, unaligned=s.unaligned,
                            progress=self.progress)
        else:
            generate(self.data, s.num_train, s.num_val, image_size=s.image_size, distractors=s.distractors, seed=s.seed,
                     captions=s.captions, faint=s.faint, progress=self.progress)

    def build(self, family: str) -> tuple[Any, Any]:
        s = self.s
        return tiny.build(
            family, width=s.width, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, vision_width=s.vision_width,
            vision_layers=s.vision_layers, image_size=s.image_size, patch_size=s.patch_size,
            vision_feature_layer=-1, spatial_pool_mode=s.video_pool, seed=s.seed,
        )

    def init(self) -> None:
        image_stage = self.s.image_steps and not self.s.image_model
        for family, folder in [(self.s.family, "init")] + ([("llava", "image-init")] if image_stage else []):
            save_pretrained_atomic(*self.build(family), self.out / folder)

    def finetune(self, model: Path, run: str, data_json: Path | None = None, batch_size: int | None = None,
                 **kw: Any) -> Path:
        s = self.s
        cfg = TrainConfig(
            model=str(model), data=str(data_json or self.train_json), output_dir=str(self.out / run),
            batch_size=batch_size or s.batch_size, cache_data=True, seed=s.seed, log_steps=25, warmup=0.05,
            num_frames=s.frames, overwrite=True, **kw,
        )
        if run in self.reuse_trained:
            model_dir, self.trained[run] = reusable_finetune(self.out, cfg, None if run == "dense-control" else s.mod_router)
            return model_dir
        if self.reuse_trained and run in FINE_TUNES:
            self.log(f"   {run}: trained again (--reuse-trained keeps {', '.join(self.reuse_trained)})")
        return train(cfg, progress=self.progress).model_dir

    def pretrain(self, first: Path) -> Path:
        """The tower learns what each patch of the training images shows before any language
        training, as LLaVA's starts from a pretrained CLIP (`vlmod.training.tower_pretrain`)."""
        pretrain_tower(first, self.data / "train.json", self.out / "tower", steps=self.s.tower_steps, seed=self.s.seed,
                       solid_only=self.s.tower_solid, progress=self.progress)
        return self.out / "tower" / "model"

    def train_on_images(self, first: Path) -> Path:
        """The image stage: a LLaVA of the same sizes learns to see on the image questions, then
        the video model starts from its weights (as LLaVA-NeXT-Video starts from LLaVA-NeXT):
        from scratch, the video model never learned colour, shape or position (39.8% after 3000 steps)."""
        s = self.s
        if s.image_model:  # an image LLaVA of the same sizes trained elsewhere (the image recipe's dense model)
            images = Path(s.image_model).expanduser()
        else:
            images = self.finetune(first, "image", self.data / "train.json", s.image_batch_size, trainable="full",
                                   train_vision_tower=True, lr=s.dense_lr, max_steps=s.image_steps,
                                   weight_decay=s.weight_decay)
        model = load_pretrained(self.out / "init")
        tiny.copy_weights(load_pretrained(images), model)
        save_pretrained_atomic(model, AutoProcessor.from_pretrained(self.out / "init"), self.out / "init-images")
        return self.out / "init-images"

    def refine(self) -> None:
        """The second dense stage: the tower frozen, the language model and projector go on at the
        dense learning rate from a fresh warm-up, distilling the first dense model's answers (a
        born-again student). Seed 0's first model answered "when" 70.6%, refined 87.8%."""
        self.finetune(self.first_dense, REFINED_RUN, trainable="language", lr=self.s.dense_lr,
                      max_steps=self.s.refine_steps, distill_from=str(self.first_dense))

    def record(self, run: str) -> None:
        write_json(self.out / run / "recipe.json", {"settings": self.s.to_dict(), "stage_seconds": dict(self.result.stages)})

    def refine_and_record(self) -> None:
        self.stages.run("refine dense", self.refine)
        self.record(REFINED_RUN)  # after the stage, so its record holds the refinement's own time

    def train_dense(self) -> None:
        """Data, a fresh tiny model, (tower pretraining, the image stage,) the dense training and
        its refinement."""
        s, stages = self.s, self.stages
        stages.run("data", self.make_data)
        stages.run("init", self.init)
        first = self.out / ("image-init" if self.video and s.image_steps else "init")
        if s.tower_steps and not s.image_model:
            first = stages.run("pretrain tower", lambda: self.pretrain(first))
        start = stages.run("train on images", lambda: self.train_on_images(first)) if s.image_steps or s.image_model else first
        stages.run("train dense", lambda: self.finetune(
            start, DENSE_RUN, trainable="full", train_vision_tower=s.dense_tower, lr=s.dense_lr, max_steps=s.dense_steps,
            weight_decay=s.weight_decay,
        ))
        self.record(DENSE_RUN)
        if s.refine_steps:
            self.refine_and_record()

    def reuse_dense(self) -> None:
        """--reuse-dense: the dense (and refined) model of an earlier run with the same settings."""
        s, result = self.s, self.result
        result.stages.update(reusable_dense(self.out, s))
        self.log(f"== reusing the dense model in {self.first_dense} (trained in {result.stages['train dense']:.0f} s)")
        if self.val_count() != s.num_val:  # another size (or none that reads); the same seed writes the same training set
            self.stages.run("data", self.make_data)
        if not s.refine_steps:
            return
        refined = reusable_refined(self.out, s)
        if refined is None and self.reuse_trained:
            raise InputError(f"--reuse-trained: the refined dense model in {self.out} is missing or was refined with "
                             "other settings, so the fine-tunes from it must train again: drop --reuse-trained")
        if refined is None:
            self.refine_and_record()
        else:
            result.stages["refine dense"] = refined["refine dense"]
            self.log(f"== reusing the refined dense model in {self.dense} (refined in {refined['refine dense']:.0f} s)")

    def val_count(self) -> int | None:
        """How many records the validation set in `out` holds; None when it is missing or damaged."""
        try:
            return len(json.loads(self.val_json.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, RecursionError, ValueError, TypeError):
            return None

    # -- evaluation helpers and the dense row --------------------------------------------------

    def evaluated(self, model: Any, name: str, baseline: bool = False, **kw: Any) -> Any:
        """`baseline`: one of the other methods, on the first `baseline_samples` questions."""
        s = self.s
        limit = s.baseline_samples if baseline else None
        report = evaluate(model, self.processor, self.val_set(kw.pop("num_frames", s.frames), limit),
                          batch_size=s.eval_batch_size, max_new_tokens=4, progress=self.progress, name=name,
                          limit=limit, **kw)
        self.log(f"   {name}: accuracy {100 * report.accuracy:.1f}%, answer loss {report.answer_loss:.3f}, "
                 f"LM GFLOPs {report.flops_by_part['language'] / 1e9:.4f}")
        return report

    def val_set(self, frames: int, limit: int | None = None) -> Any:
        """The validation set at `frames` a clip (its first `limit` records; a set of them all
        serves any limit), read once: every evaluation of the run shares its decoded clips and
        processed prompts (a clip decoded once, not once a method and point)."""
        for key in ((frames, None), (frames, limit)):
            if key in self.val_sets:
                return self.val_sets[key]
        self.val_sets[frames, limit] = LlavaDataset(
            load_records(self.val_json)[:limit], self.processor, self.val_json.parent, num_frames=frames, cache=True,
            max_tokens=max_positions(self.dense_model))
        return self.val_sets[frames, limit]

    def evaluate_dense(self) -> None:
        s = self.s
        self.processor = AutoProcessor.from_pretrained(self.dense)
        self.dense_model = load_pretrained(self.dense).eval()
        self.dims = DecoderDims.from_config(self.dense_model.config.text_config)
        # The compute points are solved on the prompts each method answers: MoD (and dense) all of
        # them, the other methods the first `baseline_samples`; at 8x the text is most of what runs,
        # so the counts of the eval set's first prompts alone put those methods off their points.
        self.counts = self.stages.run("count tokens", lambda: token_counts(self.val_set(s.frames), s, s.num_val))
        few = s.baseline_samples and s.baseline_samples < s.num_val
        self.baseline_counts = token_counts(self.val_set(s.frames), s, s.baseline_samples) if few else self.counts
        # The projector runs on every vision token that enters it (a linear cost per token).
        self.projector_per_token = projector_flops(self.dense_model, 1.0, trains=False)["forward"]
        report = self.stages.run("eval dense", lambda: self.evaluated(self.dense_model, "dense"))
        refined = f"refined +{s.refine_steps} steps" if s.refine_steps else "-"
        self.add_row("dense", None, refined, report)
        # Frame subsampling's FLOPs reference: the dense model on every frame of the questions it answers.
        self.frames_reference = report
        if self.video and s.baseline_samples and s.baseline_samples < len(report.samples):
            self.frames_reference = self.stages.run("eval dense", lambda: self.evaluated(
                self.dense_model, "dense, the first questions", baseline=True))

    # -- MoD: layers, compute points, conversion, fine-tune ------------------------------------

    def rank(self) -> list[int]:
        s = self.s
        ranks = rank_checkpoint(str(self.dense), self.train_json, num_samples=s.rank_samples, batch_size=8,
                                progress=self.progress)
        self.result.ranks = list(ranks.normalized)
        if s.mod_layers.startswith("arank:"):
            chosen = sorted(ranks.select(int(s.mod_layers.split(":", 1)[1])))
        else:
            chosen = list(range(1, s.layers))
        ranks.suggested = chosen
        write_json(self.out / "ranks.json", ranks.to_dict())
        self.log(f"   ARank normalised ranks {[round(r, 3) for r in ranks.normalized]}; converted layers {chosen}")
        return chosen

    def solve_points(self) -> None:
        """For each target reduction: each method's knob, or out of reach (`vlmod.recipes.points`)."""
        s, counts = self.s, self.counts
        self.scoring = knobs.attention_scoring_flops(self.dims, counts)  # per MoD layer
        self.result.points, self.result.ceilings = solve_points(self.dims, counts, s, self.result.layers, self.scoring,
                                                                self.baseline_counts)
        reached = [p for p in self.result.points if p["mod_capacity"] is not None]
        if not reached:
            reach = self.result.ceilings[ours(s.mod_router)[0]]
            raise InputError(f"no compute point is within MoD's reach (at most {reach:.2f}x on layers "
                             f"{self.result.layers}): give lower --targets")
        self.main = min(reached, key=lambda p: abs(p["target"] - s.goal))
        self.log(f"   tokens per sample: text {counts.text:.2f} (the first {s.baseline_samples}: "
                 f"{self.baseline_counts.text:.2f}), vision {counts.vision:.1f}; largest reductions "
                 + ", ".join(f"{m} {c:.2f}x" for m, c in self.result.ceilings.items()) + "; compute points:")
        for line in describe_points(self.result.points):  # a line each, not the raw records (results.json has them)
            self.log(f"     {line}")

    def convert_and_finetune(self) -> None:
        """Convert at the main point, fine-tune one MoD model over the capacities of the points up to
        `train_up_to` (`trained_capacities`), (`stack_steps`) train it on behind the pre-LLM
        reduction at the stacked points past that, and (dense_control) the MoD stage's training on the
        unconverted dense model."""
        s, stages, result = self.s, self.stages, self.result
        self.converted = self.out / "converted"
        stages.run("convert", lambda: convert(ConvertOptions(
            model=str(self.dense), out=str(self.converted), capacity=self.main["mod_capacity"], layers=result.layers,
            routable=["video"] if self.video else ["image"], capacity_schedule=s.schedule, router=s.mod_router,
            overwrite=True,
        )))
        # The MoD stage's training; the control repeats it on the unconverted dense model.
        mod_stage = {"trainable": "language", "lr": s.mod_lr, "max_steps": s.mod_steps,
                     "distill_from": str(self.dense) if s.distill else None}
        aux = {"aux_loss": "attention", "aux_loss_weight": s.router_aux} if s.router_aux else {}
        self.mod = stages.run("train MoD", lambda: self.finetune(
            self.converted, "mod", router_lr=s.router_lr, capacities=trained_capacities(result.points, s.train_up_to),
            capacity_warmup=s.capacity_warmup, **mod_stage, **aux,
        ))
        # The far points the MoD stage did not train at (`stack_train_from`: from there on); trained
        # on video's, the stacked model still matched or beat the MoD model stacked at 1.5x and 3x.
        train_from = s.train_up_to if s.stack_train_from is None else s.stack_train_from
        stacked = [p for p in result.points if p.get("stack_keep") is not None and p["target"] > train_from]
        self.stack, keep = self.mod, {}
        if s.stacked and s.stack_scoring == "query":  # the keep that reads the question (`vlmod.recipes.keep`)
            self.keep_dir = stages.run("fit keep", lambda: fit_keep(self.mod, self.train_json, self.processor,
                                                                    self.out / KEEP_RUN, self.progress))
            keep = {"reduce_scorer": str(self.keep_dir)}
        if s.stacked and s.stack_steps and stacked:
            draws = stack_training_points(self.dims, self.counts, s, result.layers, stacked)
            self.stack = stages.run("train stacked", lambda: self.finetune(
                self.mod, "stack", trainable="language", lr=s.stack_lr, max_steps=s.stack_steps, router_lr=s.router_lr,
                capacities=[cap for _, cap in draws], reduce_keep=[keep for keep, _ in draws],
                reduce_scoring=s.stack_scoring, reduce_pool=s.stack_pool,
                reduce_merge=s.stack_merge, distill_from=mod_stage["distill_from"], **aux, **keep,
            ))
        if s.dense_control:
            control = stages.run(CONTROL_STAGES[0], lambda: self.finetune(self.dense, "dense-control", **mod_stage))
        for run, stage in (("mod", "train MoD"), ("stack", "train stacked"), ("dense-control", CONTROL_STAGES[0])):
            if run in self.trained:
                result.stages[stage] = self.trained[run]
                self.log(f"   {stage}: reused the earlier run's model (trained in {self.trained[run]:.0f} s)")
        if s.dense_control:
            report = stages.run(CONTROL_STAGES[1], lambda: self.evaluated(load_pretrained(control).eval(), "dense control"))
            self.add_row("dense-control", None, f"+{s.mod_steps} steps as the MoD stage", report)

    def record_costs(self) -> None:
        """Each training stage's step time, tokens a second and training FLOPs (`vlmod.recipes.cost`),
        from the logs of the runs this recipe trained or reused."""
        for stage, run in TRAINING_RUNS.items():
            trained_elsewhere = run == "image" and self.s.image_model
            if stage in self.result.stages and not trained_elsewhere and (self.out / run / "train_log.json").is_file():
                data = self.data / "train.json" if run == "image" else self.train_json
                self.result.training[stage] = run_cost(self.out / run, data)

    def write_results(self) -> RecipeResult:
        self.record_costs()
        s, video = self.s, self.video
        one_frame = (lambda: one_frame_report(self.dense_model, self.processor, self.val_json, s.frames,
                                              s.baseline_samples, s.eval_batch_size, self.progress)) if video else None
        blanked = (lambda: answer_blanked_report(self.dense_model, self.processor, self.val_json, s.baseline_samples,
                                                 s.eval_batch_size, self.progress)) if s.task == "detail" else None
        self.result.set_checks = self.stages.run("set checks", lambda: check_recipe_sets(
            self.result.rows, self.train_json, self.val_json, TEMPORAL_TYPES if video else (), one_frame,
            frontier.rows_evidence(self.result.rows).enough, self.log, blanked))
        write_json(self.out / "results.json", self.result.to_dict(), strict=True)  # no NaN: strict parsers read it
        table = format_results(self.result)
        write_text(self.out / "results.md", table + "\n")
        frontier.plot_frontier(self.result.rows, self.out / "frontier.png",
                               f"synthetic {self.s.task} recipe: accuracy against compute")
        self.log(table)
        return self.result


def format_results(result: RecipeResult) -> str:
    """results.md: the frontier table, the set checks, the verdicts and the stage times."""
    from vlmod.evaluation.frontier import FRONTIER_GOALS, format_frontier, rows_evidence, verdicts

    s = result.settings
    temporal = TEMPORAL_TYPES if s.task == "video" else ()
    evidence = rows_evidence(result.rows)  # a toy run's first line says it checks the pipeline only
    lines = [] if evidence.enough else [evidence.line(), ""]
    lines += [format_frontier(result.rows, temporal, result.unreachable), ""]
    if temporal:
        lines += ["(* needs several frames)", ""]
    if result.set_checks:
        lines += [format_set_checks(result.set_checks, temporal), ""]
    lines.append(f"- converted language layers {result.layers} of {s.layers}; ARank normalised ranks "
                 f"{[round(r, 3) for r in result.ranks]}")
    dense = result.row("dense")
    if s.baseline_samples and s.baseline_samples < dense["samples"]:
        lines.append(f"- questions: dense, the control, MoD and MoD stacked on the reduction answered all "
                     f"{dense['samples']} validation questions, the other methods the first {s.baseline_samples} "
                     "(each compared with ours on those)")
    if result.ceilings:
        lines.append("- the largest LM prefill FLOPs reduction each method can reach here (its knob at one token, "
                     "one kept token, one frame): " + ", ".join(f"{m} {c:.2f}x" for m, c in result.ceilings.items()))
    if result.unreachable:
        lines.append("- out of reach, not evaluated: " + ", ".join(
            f"{u['method']} /{u['target']:g}" for u in result.unreachable))
    lines.append("- total: the whole prefill (vision tower with any scoring, projector, language model); total "
                 "reduction against dense on the same inputs")
    said = verdicts(result.rows, {**FRONTIER_GOALS, s.goal: 1.0})
    lines += [f"- {v}" for v in (said if evidence.enough else said[1:])]  # a toy run's reason is the first line
    aim = "aim >= 90%" + (", >= 85% on each type that needs several frames" if temporal else "")
    lines.append(f"- dense accuracy {100 * dense['accuracy']:.1f}% ({aim}), by type "
                 + ", ".join(f"{t} {100 * a:.1f}%" for t, a in sorted(dense["accuracy_by_type"].items())))
    total = sum(result.stages.values())
    control = sum(result.stages.get(k, 0.0) for k in CONTROL_STAGES)
    lines.append(f"- whole recipe: {total / 60:.1f} min"
                 + (f" ({(total - control) / 60:.1f} min without the control)" if control else "") + " ("
                 + ", ".join(f"{k} {v:.0f} s" for k, v in result.stages.items()) + ")")
    lines.append(format_machine(machine()))
    if result.training:
        lines += ["", "What each training stage cost (steps on the host clock; FLOPs analytic, `vlmod.recipes.cost`):",
                  "", *format_costs(result.training)]
    return "\n".join(lines)


__all__ = ["TASKS", "VIDEO_POOLS", "RecipeResult", "RecipeSettings", "format_results", "run_recipe", "token_counts"]
