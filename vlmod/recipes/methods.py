"""Stage 7 of a synthetic recipe: every method at every compute point (`vlmod.recipes.recipe`).

At each point (`vlmod.recipes.points`): the fine-tuned MoD model, the random and stride routers
on its weights, the training-free attention router (and, with "fastv" in `routers`, FastV's rule)
on the dense weights, pre-LLM reduction of the dense model (each ranking, with VisionZip's
contextual tokens), MoD stacked on pre-LLM
reduction (the MoD model behind a `PreLLMReduction`, its capacity a share of the kept tokens),
2 x 2 pooling of the dense model's tokens (pictures), frame subsampling (video); at the main point
also the MoD model with its vision tower routed. A method that cannot reach a point gets an
out-of-reach record instead of a row. Every row counts the whole prefill: the report's
tower and language model plus the projector on the vision tokens the method fed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vlmod.api import apply_mod, set_capacity, set_router, use_router
from vlmod.config import ATTENTION_ROUTERS, MoDConfig
from vlmod.evaluation import frontier, knobs
from vlmod.io.hf import load_pretrained
from vlmod.recipes.points import POOL, ours, reachable, reduction_methods
from vlmod.tools.query_keep import load_query_scorer
from vlmod.tools.reduction import PreLLMReduction, reduction_flops


class PointEvaluations:
    """The methods' evaluations, mixed into the recipe's `_Recipe`: they read its settings (`s`),
    stages, result, dense model, compute points, token counts (`counts`), the projector's FLOPs
    per vision token (`projector_per_token`) and the attention router's scoring FLOPs (`scoring`),
    and log to its `log`."""

    s: Any
    stages: Any
    log: Callable[[str], None]
    result: Any
    mod: Any  # the fine-tuned MoD model's folder
    stack: Any  # the stacked method's: the MoD model's, or the stage's that trained it on behind the reduction
    counts: Any
    dims: Any  # the language model's `DecoderDims`
    projector_per_token: float
    scoring: float
    video: bool

    def projector(self, fraction: float = 1.0) -> float:
        """The projector's prefill FLOPs per sample on `fraction` of the vision tokens (fewer frames)."""
        return self.projector_per_token * self.counts.vision * fraction

    def add_row(self, method: str, target: float | None, setting: str, report: Any, **kw: Any) -> None:
        kw.setdefault("projector", self.projector())
        self.result.rows.append(frontier.row(method, target, setting, report, **kw))

    def skip(self, method: str, point: dict[str, Any]) -> bool:
        """True (and the out-of-reach record kept) where `method` cannot reach `point`."""
        if reachable(point, method):
            return False
        self.result.unreachable.append(frontier.out_of_reach(method, point["target"], self.result.ceilings[method]))
        return True

    def evaluated_once(self, key: tuple[Any, ...], stage: str, name: str, run: Callable[[], Any]) -> Any:
        """`run`'s report, evaluated once per `key` (method, kept fraction, capacity): points a
        method runs past (the stack at capacity 1.0, pooling's every window) are one evaluation."""
        if key in self.reports:
            self.log(f"   {name}: as {self.reports[key][0]} (the same model, kept tokens and capacity)")
            return self.reports[key][1]
        report = self.stages.run(stage, run)
        self.reports[key] = (name, report)
        return report

    def evaluate_points(self) -> None:
        s, stages, result = self.s, self.stages, self.result
        self.reports: dict[tuple[Any, ...], tuple[str, Any]] = {}
        self.mod_model = mod_model = load_pretrained(self.mod).eval()
        # The stacked method's model: the MoD model trained on behind the reduction (`stack_steps`), or itself.
        self.stack_model = mod_model if self.stack == self.mod else load_pretrained(self.stack).eval()
        attention_model = load_pretrained(self.converted).eval()
        set_router(attention_model, "attention")
        alone = ours(s.mod_router)[0]
        for p in result.points:
            t = p["target"]
            with_router = [(alone, None)] + [(r, r) for r in s.routers if r not in ATTENTION_ROUTERS]
            for method, router in with_router:
                if self.skip(method, p):
                    continue
                cap = p["capacity"] if router else p["mod_capacity"]
                set_capacity(mod_model, cap)

                def run_mod(router: str | None = router, name: str = f"{method} /{t:g}") -> Any:
                    if router is None:
                        return self.evaluated(mod_model, name)
                    set_router(mod_model, router)
                    # The random router draws from torch's generator: seeded here, so a rerun
                    # (--reuse-trained, with no training before it) draws the same tokens.
                    torch.manual_seed(s.seed)
                    try:
                        return self.evaluated(mod_model, name, baseline=True)
                    finally:
                        set_router(mod_model, s.mod_router)
                self.add_row(method, t, f"capacity {cap:.3f}", stages.run(f"eval {method}", run_mod),
                             extra_language_flops=self.mod_scoring() if router is None else 0.0)
            if "attention" in s.routers and not self.skip("attention", p):
                # Its scoring costs FLOPs too: a lower capacity reaches the same total.
                set_capacity(attention_model, p["attention_capacity"])
                report = stages.run("eval attention", lambda n=f"attention /{t:g}": self.evaluated(
                    attention_model, n, baseline=True))
                self.add_row("attention", t, f"capacity {p['attention_capacity']:.3f}", report,
                             extra_language_flops=len(result.layers) * self.scoring)
            if "fastv" in s.routers and not self.skip("fastv", p):
                set_capacity(attention_model, p["fastv_capacity"])
                with use_router(attention_model, "fastv"):  # ranked once a forward: its scoring once
                    report = stages.run("eval fastv", lambda n=f"fastv /{t:g}": self.evaluated(
                        attention_model, n, baseline=True))
                self.add_row("fastv", t, f"capacity {p['fastv_capacity']:.3f}", report,
                             extra_language_flops=self.scoring)
            self.evaluate_reduction(p)
            if s.stacked:
                self.evaluate_stacked(p)
            if self.video:
                self.evaluate_frames(p)

    def mod_scoring(self, keep: float = 1.0) -> float:
        """Our MoD layers' scoring FLOPs per sample: the attention router's on the tokens they see
        (a pre-LLM reduction keeping `keep` before them) where the MoD stages train it, else none."""
        if self.s.mod_router != "attention":
            return 0.0
        return len(self.result.layers) * knobs.attention_scoring_flops(self.dims, self.counts, keep)

    def evaluate_reduction(self, p: dict[str, Any]) -> None:
        """Pre-LLM reduction with each ranking (VisionZip's two, the features' deviation from
        their frame's mean and, on clips, their novelty since the last frame): these towers are
        trained from scratch under LLaVA, which reads only the patches, so nothing trains their
        CLS; which ranking is the stronger varies by model. A `reduce_contextual` share of the
        kept slots are VisionZip's contextual tokens. Then the same keep merged instead of dropped
        (ToMe-like: each frame's most alike tokens merge until the keep is left). On pictures also 2 x 2
        pooling (every window, or the best ranked by deviation where the point asks for fewer):
        where the point asks for more than a quarter of the tokens it runs past it, at fewer FLOPs."""
        t = p["target"]
        contextual = f" ({self.s.reduce_contextual:g} contextual)" if self.s.reduce_contextual else ""
        for rank_by, method in [*reduction_methods(self.video).items(), ("deviation", "merge")]:
            if self.skip(method, p):
                continue
            merge = method == "merge"
            reducer = PreLLMReduction(self.dense_model, p["keep"], rank_by, 0.0 if merge else self.s.reduce_contextual,
                                      merge=merge)
            report = self.stages.run("eval reduce", lambda r=reducer, n=f"{method} /{t:g}": self.evaluated(
                r, n, baseline=True, flops_fn=reduction_flops))
            report.processed_fraction = {"kept": p["keep"]}
            self.add_row(method, t, f"keep {p['keep']:.3f}" + (" merged" if merge else contextual), report)
        if p.get("pool_keep") is not None and not self.skip("pool", p):
            keep = p["pool_keep"]

            def run_pool() -> Any:
                reducer = PreLLMReduction(self.dense_model, keep, "deviation", pool=POOL)
                report = self.evaluated(reducer, f"pool /{t:g}", baseline=True, flops_fn=reduction_flops)
                report.processed_fraction = {"kept": keep}
                return report
            report = self.evaluated_once(("pool", keep), "eval reduce", f"pool /{t:g}", run_pool)
            self.add_row("pool", t, f"{POOL} x {POOL} pooled, keep {keep:.3f} by deviation", report)

    def evaluate_stacked(self, p: dict[str, Any]) -> None:
        """MoD stacked on pre-LLM reduction: the fine-tuned MoD model (trained on behind the
        reduction where `stack_steps`) behind the reduction (ranked by `stack_scoring`, pooled
        `stack_pool` x `stack_pool` first where that is over 1), at the
        capacity that reaches the point on the kept tokens, on every question (ours, as MoD: the
        paired interval against dense needs them all); its FLOPs count each MoD layer on the
        tokens it ran."""
        stack = ours(self.s.mod_router)[1]
        if self.skip(stack, p):
            return
        t, keep, cap = p["target"], p["stack_keep"], p["stack_capacity"]

        def run_stacked() -> Any:
            set_capacity(self.stack_model, cap)
            scorer = load_query_scorer(self.keep_dir) if self.s.stack_scoring == "query" else None
            reducer = PreLLMReduction(self.stack_model, keep, self.s.stack_scoring, pool=self.s.stack_pool,
                                      merge=self.s.stack_merge, scorer=scorer)
            report = self.evaluated(reducer, f"stacked /{t:g}", flops_fn=reduction_flops)  # ours: every question
            # Of all the vision tokens: the MoD layers' share of the kept ones, times the kept share.
            report.processed_fraction = {k: v * keep for k, v in report.processed_fraction.items()}
            return report
        report = self.evaluated_once((stack, keep, cap), "eval stacked", f"stacked /{t:g}", run_stacked)
        behind = f", +{self.s.stack_steps} steps behind it" if self.stack != self.mod else ""
        pool = self.s.stack_pool
        split = f"{pool} x {pool} pooled" if pool > 1 else f"share {self.s.share_at(t):g}"
        kept = "merged" if self.s.stack_merge else f"by {self.s.stack_scoring}"
        self.add_row(stack, t, f"keep {keep:.3f} {kept}, capacity {cap:.3f} ({split}){behind}", report,
                     extra_language_flops=self.mod_scoring(keep) if cap < 1.0 else 0.0)  # at 1.0 nothing is scored

    def evaluate_frames(self, p: dict[str, Any]) -> None:
        """Frame subsampling of the dense model, against the dense model on every frame."""
        if self.skip("frames", p):
            return
        f, t = p["frames"], p["target"]
        report = self.stages.run("eval frames", lambda: self.evaluated(
            self.dense_model, f"frames {f}", baseline=True, num_frames=f))
        report.processed_fraction = {"frames": f / self.s.frames}
        # Against the dense model on every frame, not the report's own dense count on fewer.
        reference = {**self.frames_reference.flops_by_part, "projector": self.projector()}
        self.add_row("frames", t, f"{f} of {self.s.frames} frames", report, projector=self.projector(f / self.s.frames),
                     dense_reference=reference)

    def evaluate_vision_mod(self) -> None:
        """The main point again with the vision tower routed too (training-free, CLS attention)."""
        s, main = self.s, self.main
        set_capacity(self.mod_model, main["mod_capacity"])
        tower = MoDConfig(capacity=s.vision_capacity, layers=[s.vision_layers - 1], routable=("image",), router="attention")
        apply_mod(self.mod_model, tower, part="vision")
        report = self.stages.run("eval vision MoD", lambda: self.evaluated(
            self.mod_model, "learned + vision tower", baseline=True))
        report.processed_fraction = {k: v for k, v in report.processed_fraction.items() if k.startswith("language")}
        self.add_row("learned+vision", main["target"], f"{s.mod_router} router, capacity {main['mod_capacity']:.3f}, "
                                                       f"tower {s.vision_capacity:g}", report,
                     extra_language_flops=self.mod_scoring())


__all__ = ["PointEvaluations"]
