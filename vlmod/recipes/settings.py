"""What a synthetic recipe depends on (`RecipeSettings`, with the runs the docs quote) and what
it gives back (`RecipeResult`)."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmod.data.detail import DEFAULT_IMAGE_SIZE as DETAIL_IMAGE_SIZE
from vlmod.data.detail import DEFAULT_PATCH_SIZE as DETAIL_PATCH_SIZE
from vlmod.data.detail import DETAIL_TYPES, check_layout, check_resolution
from vlmod.data.scenes import MAX_DISTRACTORS
from vlmod.data.synthetic import check_types
from vlmod.errors import InputError
from vlmod.evaluation.frontier import OURS_BY_ROUTER
from vlmod.tools.reduction import SCORINGS

TASKS = ("image", "video", "detail")  # detail: the fine-detail set (`vlmod.data.detail`)
VIDEO_POOLS = ("average", "max", "conv")
MOD_ROUTERS = tuple(OURS_BY_ROUTER)  # the routers the MoD stages can train with (`mod_router`)
# The isoFLOP check's dense steps: its MoD runs take 1.44x (the paper's setting) and 2.12x (3x
# point) as many at the same training FLOPs, and on this project's CPU a MoD step took 1.15x and
# 0.73x a dense one's time (interleaved, on a busy machine; tiny layers, so routing's fixed costs
# weigh), so 1,500 dense steps of ~0.5 s (the image recipe's dense stage, docs/results.md) make
# the whole check about 55 minutes; the recipe's 2,500 would take about 90.
ISOFLOP_DENSE_STEPS = 1500
DEFAULT_STACK_SHARE = 0.5
# The CPU features that choose torch's, MKL's and oneDNN's kernels: another set sums floats in
# another order, so the same seed trains another model (issue 62: the video recipe on another
# machine of the same kind, dense 90.0% against this CPU's 94.5%).
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

# The detail task's stack by `stack_merge`. On token merging: 8x split 0.6 (merging / MoD, in log
# terms), trained at 0.5; which split a model holds 8x at is a draw, and 0.6 is the one within 2
# points on every page model tried (at 0.5 / 0.6 / 0.8, all 1,200 questions: seeds 0, 1, 2 96.3 / 96.1
# / 90.1%, 96.0 / 96.1 / 95.5%, 95.8 / 96.0 / 94.2%; chosen on those questions, docs/results.md). On
# 2 x 2 pooling, every window kept, as the aligned set's tables ran it (`--no-unaligned
# --no-stack-merge --dense-steps 2500`): pooling keeps a glyph on its window whole, and at 8x split
# 0.3 MoD runs about one vision token a layer (seed 2's stacked model 97.2% there, 94.6% at 0.5).
DETAIL_STACKS: dict[bool | str, dict[str, Any]] = {
    True: {"stack_merge": True, "stack_pool": 1, "stack_share": {8.0: 0.6}, "stack_train_share": {8.0: 0.5}},
    False: {"stack_merge": False, "stack_pool": 2, "stack_share": {8.0: 0.3}, "stack_train_share": None},
    # `--stack-scoring query`: a keep that reads the question drops the rest, at merging's splits.
    "query": {"stack_merge": False, "stack_pool": 1, "stack_share": {8.0: 0.6}, "stack_train_share": {8.0: 0.5}},
}

@dataclass
class RecipeSettings:
    """Everything a recipe depends on; `for_task` gives the runs docs/results.md quotes."""

    task: str = "image"
    num_train: int = 16000
    num_val: int = 2400
    baseline_samples: int | None = 400
    image_size: int = 32
    frames: int = 8
    video_pool: str = "average"
    # Extra shapes in the image scenes (0: one shape a colour / shape / position question). Video with 2
    # (the image stage then asks which of several objects): seed 1's `order` still at chance, seed 0's
    # 91.9 -> 74.2% at stage 3 (docs/results-history.md, "Image scenes with distractors do not teach it").
    distractors: int = 0
    captions: bool = False
    # The fine-detail set's glyphs and markers, drawn over glyph_scale x glyph_scale patches, and its
    # question types (`vlmod.data.detail`; None: every type; other tasks leave both as they are).
    glyph_scale: int = 1
    types: tuple[str, ...] | None = None
    question_first: bool = False  # the fine-detail prompts put the question before the picture
    layout: str = "scene"  # the fine-detail pictures' layout (`vlmod.data.detail.LAYOUTS`)
    # The share of pictures drawn faint: the shapes' at the video set's faint range
    # (`vlmod.data.synthetic.FAINT_CONTRAST`), the fine-detail glyphs' at theirs (`vlmod.data.detail`).
    faint: float = 0.0
    # The fine-detail cells' grid starts 0 to glyph_scale - 1 patches in, drawn per picture, so glyphs
    # straddle the 2 x 2 pooling windows (on the grid, pooling keeps every glyph whole: docs/data.md).
    unaligned: bool = False
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
    # The dense stage trains the tower too. The fine-detail set's is frozen: trained on, it forgot
    # the glyphs (a linear probe of the projected glyph tokens: digit 99.1% after tower pretraining,
    # 16.9% after 1,500 dense steps; the dense model at chance, docs/data.md).
    dense_tower: bool = True
    # Tower pretraining on the solid pictures only (a faint picture's labels name shapes the noise may
    # hide). Off: with a fifth of every type faint, seed 0 scored shape 80.5% with it off (solid pictures
    # 89.7%, an Intel Xeon), 75.7% with it on (86.0%, an AMD EPYC).
    tower_solid: bool = False
    weight_decay: float = 0.05
    batch_size: int = 32
    mod_layers: str = "all"
    schedule: str | None = None
    targets: tuple[float, ...] = (1.5, 2.0, 3.0, 3.5, 5.0, 8.0)
    # The MoD stage trains at the capacities of the points up to this reduction (each step draws
    # one); points past it are evaluated on that model as trained (3.5: the draws of the published
    # video run; 5x's capacity is 2 of 128 vision tokens a layer there).
    train_up_to: float = 3.5
    goal: float = 3.0
    rank_samples: int = 64
    mod_steps: int = 2100
    mod_lr: float = 5e-4
    capacity_warmup: float = 0.0
    router_lr: float = 5e-3
    # Weight of the attention aux loss in the MoD and stacked stages (`MoDConfig.aux_loss`): the learned
    # router is taught the tokens the attention router would run at each layer; 0: none. Off: on the
    # detail set (seed 1) 0.1 lifted MoD at 1.5x and 2x (94.4 -> 97.6%, 91.9 -> 96.2%) but not at 3x
    # (85.6 -> 84.9%) or 3.5x (79.2 -> 74.6%), and the stage's loss rose 0.48 -> 1.04 in steps 25-325.
    router_aux: float = 0.0
    # The router the MoD and stacked stages train and run with: "learned" (the shared linear router,
    # `MoDConfig.router`) or "attention" (each layer ranks tokens by the attention text pays them:
    # no parameters, its scoring counted in every FLOPs figure; gate and weights fine-tuned to it).
    # Learned on images and video: on video (seed 2) the attention router ranked worse at 3x (dense
    # weights, first 420: 79.8% against the learned router's 92.6%); detail: attention (below).
    mod_router: str = "learned"
    routers: tuple[str, ...] = ("random", "stride", "attention")
    vision_capacity: float = 0.5
    stacked: bool = True  # MoD stacked on pre-LLM reduction at every point (`vlmod.evaluation.frontier.solve_stacked`)
    # The pre-LLM reduction's share of a stacked point's reduction, in log terms (0.5: each does the
    # square root), MoD the rest: one share for every point, or {target: share} (a target it does
    # not name: DEFAULT_STACK_SHARE). Video seed 0 (docs/results-history.md): by attention, 0.5 was best
    # at 5x (first 420: 93.8%; 92.6% at 0.85) and 8x wanted more (0.5: 77.1%, 0.85: 88.8%); by
    # novelty the reduction takes 0.85 everywhere (the stage trained at 0.5 / 0.85, all 2,520
    # questions, 5x at share 0.5 / 0.7 / 0.85 / 0.95: 93.1 / 94.0 / 94.4 / 94.3%, 3x 93.2 -> 93.7%).
    stack_share: float | dict[float, float] = DEFAULT_STACK_SHARE
    # The split the stacked stage (below) trains at, as `stack_share` (a target it does not name, or
    # None: where the point runs). Video trains 5x at 0.5 and runs every point at 0.85: trained at
    # 0.85 at 5x too, the stage's loss jumped after the warm-up (0.23 -> 0.79 at step 200, 0.22 at
    # the end against 0.07) and it scored 89.9% at 5x and 88.3% at 8x, against 94.4% and 94.2%
    # (all 2,520 questions).
    stack_train_share: float | dict[float, float] | None = None
    # Its ranking (`vlmod.tools.reduction.SCORINGS`). Seed 0, the stacked stage trained behind
    # each, first 420 / 400 questions: video 5x 93.3% by every query's attention, 95.2% by the
    # features' deviation; 8x 86.7 -> 90.0%; images 5x 73.2 -> 87.2%. Video's default, the
    # features' novelty since the last frame, takes 8x from 88.6% to 94.2% (all 2,520 questions).
    stack_scoring: str = "deviation"
    # With N > 1 the stack's reduction averages each picture's tokens in N x N windows first and keeps
    # every window (LLaVA-OneVision's 2 x 2 pooling), MoD reaching the rest of each point; a point the
    # pooling alone passes runs at capacity 1.0, past it. 1: the reduction drops (`stack_share`).
    stack_pool: int = 1
    # On: the stack's reduction merges each picture's (frame's) most alike tokens until its keep is
    # left (`vlmod.tools.merging`, ToMe-like) instead of dropping the worst ranked; MoD the rest of
    # the point (`stack_share`). Unaligned fine-detail seed 0, dense weights, training-free, first 400
    # questions: a third kept 93.5% merged against 66.0% dropped by deviation (dense 96.3%).
    stack_merge: bool = False
    # The share of the reduction baselines' kept slots that are VisionZip's contextual tokens (the
    # dropped ones merged by similarity; VisionZip keeps 54 dominant + 10 contextual of 64). Video
    # seed 0, first 420 questions, every query's attention: 55.0% -> 57.6% at 8x, +-0.3 up to 3.5x.
    reduce_contextual: float = 0.15
    # The stacked method's own stage: the MoD model trained this many more steps behind the
    # reduction, each step at the (keep, capacity) of one stacked point past `train_up_to`; 0: the
    # MoD model runs stacked as it was trained (it never saw a reduced input, nor 8x's capacity).
    # Video seed 0, 8x: 65.0% without it; 68.6% after 500 steps at 2.5e-4 over every stacked
    # point; 77.1% after 1,000 at 5e-4 over the far points alone (docs/results-history.md).
    stack_steps: int = 1000
    stack_lr: float = 5e-4
    # That stage draws the stacked points past this LM FLOPs reduction; None: past `train_up_to`
    # (those the MoD stage did not train at). Images train at every point (1.0): trained at 5x
    # alone, the image stack scored 69.3% at 1.5x and 89.1% at 5x; at every point 89.2% and 87.2%
    # (first 400 questions, deviation ranking); video's at 5x and 8x holds up at the near points.
    stack_train_from: float | None = None
    distill: bool = True
    dense_control: bool = False
    eval_batch_size: int = 32
    seed: int = 0
    threads: int | None = None

    @classmethod
    def for_task(cls, task: str, quick: bool = False, isoflop: bool = False, **overrides: Any) -> RecipeSettings:
        """The defaults of `task` ("image", "video" or "detail"); `quick`: toy sizes that run the whole
        pipeline in well under two minutes (for tests; its accuracies mean nothing); `isoflop`:
        the isoFLOP check's (`vlmod.recipes.isoflop`), whose dense stage is shorter
        (ISOFLOP_DENSE_STEPS) so that it and the two MoD runs of its FLOPs fit about an hour."""
        if task not in TASKS:
            raise InputError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
        base: dict[str, Any] = {"task": task}
        if task == "detail":
            # The shapes recipe's stages on the fine-detail set, at the resolution where its answers stay
            # within 5% of the vision tokens (96 px, 8 px patches: 144 tokens; docs/data.md).
            base.update(image_size=DETAIL_IMAGE_SIZE, patch_size=DETAIL_PATCH_SIZE, dense_tower=False)
        if task in ("image", "detail"):
            # Tower pretraining: the dense model 91.6% -> 99.5% (shape 71.0% -> 98.3% at stage 3; seed 0, all
            # 2,400 questions). Refinement, which lifted video's `when`, left it at 99.5%: not on.
            # The stacked stage 2,000 steps, not 1,000: 5x 98.4% -> 99.5% (the last run's MoD model trained
            # behind the reduction again); the recipe with it: 99.2% at 5x, -0.4 against dense (seed 0,
            # all 2,400 questions; docs/results.md, the probe in docs/results-history.md).
            base.update(stack_train_from=1.0, tower_steps=1500, stack_steps=2000)
        if task == "image" and not isoflop:
            # Half the colour, count and position pictures faint (contrast 0.03-0.3, the video set's faint
            # clips; shape questions stay solid, `synthetic.FAINT_TYPES`): with every shape solid, dense
            # scored 99.5% and 99.9% (seeds 0, 1), no room above, so every method that kept the one shape
            # won; a fifth of every type faint took shape to 75.7-80.5% (docs/results.md). The isoFLOP
            # check keeps the solid set it reports.
            base.update(faint=0.5)
        if task == "detail":
            # 144 vision tokens an image (2.2x the shapes set's 64): the shapes recipe's steps would take
            # over two hours. A tower of 600 steps reads the glyphs (digit 99.1%, held-out pictures).
            base.update(num_train=8000, num_val=1200, tower_steps=600, dense_steps=1500, mod_steps=1000, stack_steps=1000)
            # Glyphs over 2 x 2 patches (4 of 144 tokens, 2.8%), the question first: at one patch the dense
            # model stayed at 22% (chance 15.6%); over 2 x 2 with the question after the picture 68.0%, first
            # 82.7% (seed 0, first 300 questions). A tower of 2,000 steps read a quarter glyph's digit at
            # 90.0%, of 600 at 31.9% (docs/data.md).
            base.update(glyph_scale=2, types=("digit", "small_color"), question_first=True, tower_steps=2000)
            # Glyphs filling a page, not a few among large shapes: on the scene the tiny tower spread each
            # glyph over every token, so no reduction could lose (3x by deviation 83.0%, dense 82.2%).
            base.update(layout="page", dense_steps=2500)
            # 24,000 training pictures, not 8,000: at 8,000 seeds 0 and 2 memorised their pages (25.8%
            # and 28.1% on validation); at 24,000 seed 2 scored 99.5% (docs/data.md).
            base.update(num_train=24000)
            # The attention router in the MoD stages: the learned one did not find the asked glyph (seed 2
            # at 3x: learned 68.4%, attention 99.7%, dense 99.5%; docs/results-history.md).
            base.update(mod_router="attention")
            # The digit question alone, 20% of the pictures faint (contrast 0.05-0.5): `small_color` was a
            # lottery (seed 0 read another glyph's colour in 128 of 200) and left no room above (99.5%).
            base.update(types=("digit",), faint=0.2)
            # The glyphs off the 2 x 2 pooling windows (`unaligned`, as text lies on real pictures): on the
            # windows pooling kept every glyph whole, training-free within 2.0-7.0 points at 3.96x. So the
            # stack on token merging (`DETAIL_STACKS`, with why its 8x split). 4,000 dense steps: after 2,500
            # the page's seeds 1 and 2 had not found the glyph (37.9%, 25.8%), after 4,000 96.1% and 95.9%
            # (docs/results-history.md).
            stack = "query" if overrides.get("stack_scoring") == "query" else bool(overrides.get("stack_merge", True))
            base.update(unaligned=True, dense_steps=4000, **DETAIL_STACKS[stack])
        if isoflop:
            # The check as docs/results.md reports it: MoD and dense from the same random tower.
            base.update(dense_steps=ISOFLOP_DENSE_STEPS, tower_steps=0)
        if task == "video":
            # mod_lr 5e-4, not 1e-3: at 1e-3 the MoD stage's loss spikes right after the warm-up
            # (steps 125-225), and whether it recovers turns on float rounding: the same 1,500 steps
            # gave 93.8% at 3x with one build and 87.9% with another whose losses matched the first
            # to 1e-7. At 5e-4 neither build spikes (docs/results-history.md, "The video regression").
            # router_lr 1e-3, not 5e-3: at 5e-3 seed 1's MoD stage diverged at step 600 (loss 0.12 -> 1.60;
            # 75.5% at 3x, the stack 73.2% at 5x); at 1e-3 seed 1 scores 80.6% at 3x and 80.0% at 5x and
            # 8x (dense 81.0%), and seed 0 95.0% at 3x, 94.5% at 5x, 94.4% at 8x (dense 94.5%).
            base.update(num_train=8000, num_val=2520, baseline_samples=420, batch_size=16, eval_batch_size=16, captions=True,
                        image_steps=2000, num_train_images=8000, dense_steps=2000, mod_steps=1500, mod_lr=5e-4, router_lr=1e-3,
                        tower_steps=1500, refine_steps=1500, stack_share=0.85, stack_train_share={5.0: 0.5},
                        stack_scoring="novelty")
        if quick:
            # Every compute point of the full recipe, and its depth and vision tokens per sample (64 an
            # image, 128 a clip: 8 frames of 16), so the same points are within (or out of) each method's reach.
            base.update(
                num_train=28 if task == "video" else 32, num_val=7 if task == "video" else 8, width=64,
                vision_width=32, dense_steps=3, mod_steps=2, rank_samples=4, batch_size=8, eval_batch_size=16,
                # Matrices this small run faster on one thread: a second one's sync costs more than
                # its share of the work (an eval of 4 clips took 4.0 s on two threads, 0.3 s on one,
                # on a busy machine).
                threads=1,
            )
            base.update(baseline_samples=4, stack_steps=2, tower_steps=0 if isoflop else 2)
            if task == "video":
                base.update(image_steps=2, num_train_images=16, refine_steps=2)
        if task == "detail" and overrides.get("glyph_scale", 2) < 2 and "unaligned" not in overrides:
            base.update(unaligned=False)  # a cell of one patch lies on every grid: nothing to move
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not self.targets or not all(math.isfinite(t) and t > 1.0 for t in self.targets):
            raise InputError(f"targets are finite LM FLOPs reductions > 1 (e.g. 2 for half the FLOPs), got {self.targets}")
        if self.task == "video" and self.tower_steps and not (self.num_train_images or self.image_model):
            raise InputError("tower pretraining learns on the image set: give num_train_images > 0 or tower_steps 0")
        if not math.isfinite(self.train_up_to):  # nan compares false with everything: it trained at the first point
            raise InputError(f"train_up_to must be a finite number (an LM FLOPs reduction > 1), got {self.train_up_to}")
        if self.train_up_to <= 1.0:
            raise InputError(f"train_up_to is an LM FLOPs reduction > 1, got {self.train_up_to}")
        self.stack_share = _shares("stack_share", self.stack_share)
        if self.stack_train_share is not None:
            self.stack_train_share = _shares("stack_train_share", self.stack_train_share)
        if self.stack_train_from is not None and not self.stack_train_from >= 1.0:
            raise InputError(f"stack_train_from is an LM FLOPs reduction >= 1 (1: every stacked point), got "
                             f"{self.stack_train_from}")
        if self.stack_steps < 0 or not self.stack_lr > 0:
            raise InputError(f"stack_steps is >= 0 (0: no stage of its own) and stack_lr > 0, got {self.stack_steps} and "
                             f"{self.stack_lr}")
        if not (math.isfinite(self.router_aux) and self.router_aux >= 0):
            raise InputError(f"router_aux is the weight of the attention aux loss, >= 0 (0: none), got {self.router_aux}")
        if self.mod_router not in MOD_ROUTERS:
            raise InputError(f"mod_router must be one of {', '.join(MOD_ROUTERS)}, got {self.mod_router!r}")
        if self.mod_router == "attention" and self.router_aux:
            raise InputError("router_aux teaches the learned router the attention router's choice: with mod_router "
                             "attention there is no learned router to teach; leave router_aux at 0")
        if not 0.0 <= self.reduce_contextual < 1.0:
            raise InputError(f"reduce_contextual is the share of the kept slots that are merged, in [0, 1), got "
                             f"{self.reduce_contextual}")
        if self.stack_scoring not in (*SCORINGS, "query"):
            raise InputError(f"stack_scoring must be one of {', '.join(SCORINGS)} or query, got {self.stack_scoring!r}")
        if self.stack_scoring == "query" and (self.stack_merge or self.stack_pool > 1 or self.task == "video"):
            raise InputError("--stack-scoring query keeps the tokens its scorer ranks highest in pictures: give "
                             "--no-stack-merge --stack-pool 1 (and a picture task)")
        if isinstance(self.stack_pool, bool) or not isinstance(self.stack_pool, int) or self.stack_pool < 1:
            raise InputError(f"stack_pool is the side of the windows the stack pools, a whole number >= 1 (1: none), "
                             f"got {self.stack_pool!r}")
        if self.stack_merge and self.stack_pool > 1:
            raise InputError(f"--stack-merge and --stack-pool {self.stack_pool} are two ways of merging the stack's "
                             "tokens: give --stack-pool 1 with --stack-merge")
        if self.stack_pool > 1 and self.task == "video":
            raise InputError("--stack-pool pools pictures: the video model pools its frames already; give --stack-pool 1 "
                             "with --task video")
        if self.stack_pool > 1 and (self.image_size // self.patch_size) % self.stack_pool:
            side = self.image_size // self.patch_size
            raise InputError(f"--stack-pool {self.stack_pool}: the pictures' {side} x {side} patches do not split into "
                             f"{self.stack_pool} x {self.stack_pool} windows; give an --image-size whose patch grid "
                             f"divides by {self.stack_pool}, or --stack-pool 1")
        if not 0 <= self.distractors <= MAX_DISTRACTORS:
            raise InputError(f"distractors is the number of extra shapes in an image scene, 0 to {MAX_DISTRACTORS}, got "
                             f"{self.distractors}")
        if self.task == "detail":  # answers within 5% of the vision tokens, else refused before any stage
            self.types = DETAIL_TYPES if self.types is None else check_types(self.types, DETAIL_TYPES, "fine-detail")
            check_layout(self.layout, self.types)
            check_resolution(self.image_size, self.patch_size, self.glyph_scale, self.types)
            if self.distractors:  # its pictures have their own clutter (`vlmod.data.detail`)
                raise InputError(f"--distractors is the shapes set's extra shapes; the fine-detail set draws its own "
                                 f"clutter: leave it out of --task detail (got {self.distractors})")
        elif (self.glyph_scale != 1 or self.types is not None or self.question_first or self.layout != "scene"
              or self.unaligned):
            raise InputError(f"--glyph-scale, --types, --question-first, --layout and --unaligned shape the "
                             f"fine-detail set: give them with --task detail, not --task {self.task}")
        if not 0.0 <= self.faint <= 1.0:
            raise InputError(f"--faint is the share of pictures drawn faint, 0 to 1, got {self.faint}")
        if self.faint and self.task == "video":
            raise InputError(f"--faint draws a share of the pictures faint in the image and detail tasks; the video "
                             f"task's clips draw their own faint fifth: leave it out of --task video (got {self.faint})")
        if self.unaligned and self.glyph_scale < 2:
            raise InputError("--unaligned moves the cells off the 2 x 2 grid of glyph-scale-2 glyphs; a cell of one "
                             "patch has no grid to leave: give --glyph-scale 2 or more")
        if self.task == "video" and self.frames < 2:  # else the data stage's ValueError, as a traceback
            raise InputError(f"frames is the frames of a clip, >= 2 for the video task's moving objects, got "
                             f"{self.frames}")
        if self.video_pool not in VIDEO_POOLS:
            raise InputError(f"video_pool must be one of {', '.join(VIDEO_POOLS)}, got {self.video_pool!r}")
        self.targets = tuple(sorted(float(t) for t in self.targets))
        self.routers = tuple(self.routers)

    def share_at(self, target: float, training: bool = False) -> float:
        """The pre-LLM reduction's share of the stacked point at `target` (`stack_share`; `training`:
        where the stacked stage trains at it, `stack_train_share`, else where it runs)."""
        if training and self.stack_train_share is not None:
            if not isinstance(self.stack_train_share, dict):
                return self.stack_train_share
            if float(target) in self.stack_train_share:
                return self.stack_train_share[float(target)]
        if isinstance(self.stack_share, dict):
            return self.stack_share.get(float(target), DEFAULT_STACK_SHARE)
        return self.stack_share

    @property
    def family(self) -> str:
        return "llava_next_video" if self.task == "video" else "llava"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"], d["routers"] = list(self.targets), list(self.routers)
        return d


def with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's saved settings, with the default of each setting added since that run (as JSON holds it)."""
    return {**json.loads(json.dumps(RecipeSettings().to_dict())), **saved}


# The recipe setting each size in an image model's config.json must equal (`check_image_model`).
_IMAGE_MODEL_SIZES = (
    ("text_config", "hidden_size", "width"), ("text_config", "num_hidden_layers", "layers"),
    ("text_config", "num_attention_heads", "heads"), ("text_config", "num_key_value_heads", "kv_heads"),
    ("vision_config", "hidden_size", "vision_width"), ("vision_config", "num_hidden_layers", "vision_layers"),
    ("vision_config", "image_size", "image_size"), ("vision_config", "patch_size", "patch_size"),
)


def check_image_model(s: RecipeSettings) -> None:
    """InputError, before any stage runs, when `s.image_model`'s config.json gives other sizes than
    the recipe's: its weights are copied into the video model, so they must fit it (found by the
    copy, it was refused only after the data stage had run)."""
    if not s.image_model:
        return
    path = Path(s.image_model).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:120]
        raise InputError(f"--image-model {s.image_model}: cannot read its config.json ({reason})") from None
    if not isinstance(config, dict):
        raise InputError(f"--image-model {s.image_model}: its config.json is not a JSON object")
    differ = []
    for part, key, setting in _IMAGE_MODEL_SIZES:
        sub = config.get(part)
        got = sub.get(key) if isinstance(sub, dict) else None  # a size it does not give: the copy checks it
        if got is not None and got != getattr(s, setting):
            differ.append(f"{setting} {got} (this recipe: {getattr(s, setting)})")
    if differ:
        raise InputError(f"--image-model {s.image_model} has other sizes than this recipe's video model: "
                         f"{', '.join(differ)}; give an image model of the same sizes (the image recipe's dense/model "
                         "run with the same size flags and --quick or not), or leave --image-model out")


@dataclass
class RecipeResult:
    settings: RecipeSettings
    rows: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    layers: list[int] = field(default_factory=list)
    ranks: list[float] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)
    ceilings: dict[str, float] = field(default_factory=dict)  # each method's largest LM FLOPs reduction
    unreachable: list[dict[str, Any]] = field(default_factory=list)  # (method, point)s past their ceiling
    training: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # a training stage's cost
    set_checks: dict[str, Any] = field(default_factory=dict)  # `vlmod.evaluation.set_checks`

    def row(self, method: str, target: float | None = None) -> dict[str, Any]:
        return next(r for r in self.rows if r["method"] == method and r["target"] == target)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.to_dict(),
            "converted_layers": self.layers,
            "normalized_ranks": self.ranks,
            "compute_points": self.points,
            "max_language_reduction": self.ceilings,
            "out_of_reach": self.unreachable,
            "results": self.rows,
            "stage_seconds": self.stages,
            "training_stages": self.training,
            "set_checks": self.set_checks,
            "total_seconds": sum(self.stages.values()),
            "machine": machine(),
        }


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of `KERNEL_FLAGS` it has (Linux's /proc/cpuinfo; elsewhere
    the processor name and no flags)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.processor(), []
    info = dict(line.split(":", 1) for line in lines if ":" in line)  # the last CPU's, all alike
    info = {k.strip(): v.strip() for k, v in info.items()}
    have = set(info.get("flags", "").split())
    name = info.get("model name", platform.processor())
    if "cpu family" in info:  # a virtual machine may name only the vendor ("AMD EPYC")
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    return name, [f for f in KERNEL_FLAGS if f in have]


def machine() -> dict[str, Any]:
    """What the trained numbers depend on besides the settings: the library versions and the
    kernels and threads the float sums run on (the same seed on another CPU trains another model)."""
    import av
    import numpy
    import PIL
    import transformers

    cpu, flags = _cpu()
    return {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__, "pillow": PIL.__version__,
            "av": av.__version__,  # the clips' encoder and scaler (RGB to YUV and back)
            "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": flags,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def format_machine(m: dict[str, Any]) -> str:
    """results.md's machine line, from `machine()` (a results.json of an older build lacks keys)."""
    flags = " ".join(m.get("cpu_flags") or []) or "none listed"
    return (f"- machine: torch {m.get('torch', '?')}, transformers {m.get('transformers', '?')}, numpy "
            f"{m.get('numpy', '?')}, Pillow {m.get('pillow', '?')}, PyAV {m.get('av', '?')}; {m.get('cpu', '?')}, torch kernels "
            f"{m.get('cpu_capability', '?')} (flags {flags}), {m.get('threads', '?')} thread{'' if m.get('threads') == 1 else 's'}"
            + (f", {m['cuda']}" if m.get("cuda") else "") + f"; {m.get('platform', '?')}. The float sums follow "
            "the kernels and threads: another CPU trains another model from the same seed")


def _shares(name: str, share: float | dict[Any, Any]) -> float | dict[float, float]:
    """A split setting checked (each share in (0, 1)), as floats (JSON gives the targets as strings)."""
    try:
        shares = {float(t): float(v) for t, v in share.items()} if isinstance(share, dict) else float(share)
    except (TypeError, ValueError):
        shares = None
    values = shares.values() if isinstance(shares, dict) else [shares]
    if shares is None or not all(0.0 < v < 1.0 for v in values):
        raise InputError(f"{name} is the pre-LLM reduction's share of a stacked point, in (0, 1), got {share}")
    return shares


__all__ = ["DEFAULT_STACK_SHARE", "DETAIL_STACKS", "ISOFLOP_DENSE_STEPS", "KERNEL_FLAGS", "TASKS", "VIDEO_POOLS", "RecipeResult",
           "RecipeSettings", "check_image_model", "format_machine", "machine", "with_defaults"]
