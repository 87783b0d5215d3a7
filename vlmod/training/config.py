"""A fine-tuning run's settings: `TrainConfig` (the keys of `configs/finetune/*.yaml`) and their
checks. The command-line flags that fill it (`--config` plus overrides) live in `vlmod.cli.finetune`.

Kept apart from the training loop (`vlmod.training.train`) so that what a run is can be read, checked and
compared (resume refuses changed settings: `vlmod.training.resume`) without the loop's imports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmod.config import DTYPES, MoDConfig
from vlmod.errors import TrainError, brief
from vlmod.io.files import read_yaml_mapping
from vlmod.tools.reduction import SCORINGS as REDUCE_SCORINGS

TRAINABLE = ("router", "language", "lora", "full")
SCHEDULERS = ("cosine", "linear", "constant")
PRECISIONS = ("no", "fp16", "bf16")
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "trackio", "all")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Default learning rates: the full-model one, and the routers-only one (`trainable: router`, as
# configs/finetune/llava-1.5-7b-router.yaml: a few thousand fresh parameters learn fast).
LR = 2e-5
ROUTER_ONLY_LR = 1e-3


@dataclass
class TrainConfig:
    """One fine-tuning run; the keys of `configs/finetune/*.yaml`.

    model: checkpoint directory or hub id (dense or already converted by `vlmod convert`).
    data / val_data: LLaVA-format JSON (paths relative to `image_root`, default the JSON's folder).
    dtype: the frozen weights' dtype, "auto" for the checkpoint's own (a bfloat16 7B stays 13.5 GB);
        the weights that train are float32 master weights whatever it is (a full fine-tune: 16 bytes
        a trained parameter with AdamW), and a bfloat16 / float16 model runs its forward under
        autocast in that dtype when mixed_precision is "no".
    mod: MoDConfig fields to convert the language model before training (e.g. {capacity: 0.5,
        layers: [2, 3], routable: [image]}); None trains the model as loaded.
    aux_loss / aux_loss_weight: override the router aux loss of an already converted model.
    lr: None gives LR, or ROUTER_ONLY_LR when only the routers train.
    max_steps: optimizer steps; None runs `epochs` epochs.
    warmup: warm-up steps (>= 1) or a fraction of the run (< 1).
    save_steps / eval_steps / log_steps: every N optimizer steps (0: never; a final save always).
    save_total_limit: keep the newest N checkpoints, deleting older ones as each new one is saved;
        None or 0: keep every one (a negative value is refused).
    report_to: accelerate trackers (tensorboard, wandb, ...), logged under `output_dir/logs`.
    resume: None, "latest" (the newest checkpoint in `output_dir/checkpoints`) or a checkpoint dir.
    overwrite: delete what an earlier run left in `output_dir` (checkpoints, model, logs) first.
    capacities: train each step at a mean MoD capacity drawn from this list (seeded by step), so one
        model serves every listed compute point (set one with `vlmod.set_capacity`); the saved model
        keeps the capacity it was converted with. None: always that capacity.
    capacity_warmup: steps (>= 1) or a fraction of the run (< 1) over which each step's capacity
        falls linearly from 1.0 to the one it would run at (its draw, or the converted capacity):
        skipping most tokens at once turns a converted model's loss from the dense model's into
        ten times that, which the first part of the run then only repairs; 0: no warm-up.
    distill_from: a checkpoint (the dense original) whose answer distribution the model learns to
        match as well (`vlmod.training.distill`), weighted by `distill_weight`; None: plain fine-tuning.
    reduce_keep / reduce_scoring: train behind a pre-LLM reduction (`vlmod.tools.reduction`): only
        this fraction of each sample's vision tokens enters the language model, ranked by the
        tower's attention ("mean": every query's, the default; "cls": the CLS token's) or by the
        features ("deviation" from their frame's mean; "novelty": that, capped on a clip past its
        first frame by the change since the frame before; `vlmod.tools.reduction`), so a MoD
        model learns to route what the reduction keeps, as it will run stacked on it. A list as
        long as `capacities` pairs them: each step draws one compute point, the i-th keep with the
        i-th capacity (one model for every stacked point). The teacher still sees every token.
        One process only. None: every vision token enters.
    reduce_contextual: the share of the kept slots that carry VisionZip's contextual tokens (the
        dropped tokens merged by similarity) behind that reduction; 0: the best ranked tokens only.
    reduce_pool: that reduction first averages each frame's tokens in reduce_pool x reduce_pool
        windows (every patch enters, pooled; each keep then at most 1 / reduce_pool ** 2); 1: none.
    reduce_merge: that reduction merges each frame's most alike tokens until the keep is left
        (`vlmod.tools.merging`, ToMe-like) instead of dropping the worst ranked.
    reduce_scorer: with reduce_scoring "query", the folder of the fitted scorer that reads the
        question (`vlmod.tools.query_keep.save_query_scorer`).
    """

    model: str
    data: str
    output_dir: str
    image_root: str | None = None
    val_data: str | None = None
    strict: bool = False
    mod: dict[str, Any] | None = None
    aux_loss: str | None = None
    aux_loss_weight: float | None = None
    trainable: str = "language"
    dtype: str = "auto"
    train_vision_tower: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    lr: float | None = None
    router_lr: float | None = None
    weight_decay: float = 0.0
    scheduler: str = "cosine"
    warmup: float = 0.03
    max_steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    num_workers: int = 0
    cache_data: bool = False
    num_frames: int = 8
    seed: int = 0
    save_steps: int = 0
    save_total_limit: int | None = 2
    eval_steps: int = 0
    log_steps: int = 10
    report_to: list[str] = field(default_factory=list)
    resume: str | None = None
    overwrite: bool = False
    capacities: list[float] | None = None
    capacity_warmup: float = 0.0
    distill_from: str | None = None
    distill_weight: float = 1.0
    reduce_keep: float | list[float] | None = None
    reduce_scoring: str | None = None
    reduce_contextual: float = 0.0
    reduce_pool: int = 1
    reduce_merge: bool = False
    reduce_scorer: str | None = None

    def __post_init__(self) -> None:
        choices = {
            "trainable": (self.trainable, TRAINABLE),
            "scheduler": (self.scheduler, SCHEDULERS),
            "mixed_precision": (self.mixed_precision, PRECISIONS),
            "dtype": (self.dtype, DTYPES),
        }
        for key, (value, valid) in choices.items():
            if value not in valid:
                raise TrainError(f"{key} must be one of {', '.join(valid)}; got {brief(value)}")
        if self.lr is None:
            self.lr = ROUTER_ONLY_LR if self.trainable == "router" else LR
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        for tracker in self.report_to:
            if tracker not in TRACKERS:
                raise TrainError(f"report_to: unknown tracker {brief(tracker)}; accelerate knows {', '.join(TRACKERS)}")
        positive = {
            "lr": self.lr, "batch_size": self.batch_size, "epochs": self.epochs,
            "gradient_accumulation_steps": self.gradient_accumulation_steps, "lora_r": self.lora_r,
            "lora_alpha": self.lora_alpha, "num_frames": self.num_frames,
        }
        for key, value in positive.items():
            if not value > 0:
                raise TrainError(f"{key} must be > 0, got {value}")
        if not (math.isfinite(self.distill_weight) and self.distill_weight >= 0):
            raise TrainError(f"distill_weight must be a finite number >= 0, got {self.distill_weight}")
        for c in self.capacities or []:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 < c <= 1.0:
                raise TrainError(f"capacities must be numbers in (0, 1], got {brief(self.capacities)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise TrainError(f"max_steps must be >= 1 (or left out to train by epochs), got {self.max_steps}")
        for key in ("save_steps", "eval_steps", "log_steps", "num_workers", "warmup", "weight_decay", "capacity_warmup"):
            if getattr(self, key) < 0:
                raise TrainError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.save_total_limit is not None and self.save_total_limit < 0:
            raise TrainError(f"save_total_limit is how many of the newest checkpoints to keep, >= 1 (0 or empty: every "
                             f"one), got {self.save_total_limit}")
        for key in ("lr", "epochs", "warmup", "weight_decay", "max_grad_norm", "lora_dropout", "router_lr",
                    "aux_loss_weight", "capacity_warmup"):
            value = getattr(self, key)
            if isinstance(value, float) and not math.isfinite(value):
                raise TrainError(f"{key} must be a finite number, got {value}")
        # LoRA's settings here, not in peft's words after the model has loaded.
        if not 0.0 <= self.lora_dropout < 1.0:
            raise TrainError(f"lora_dropout is the share of LoRA inputs dropped in training, in [0, 1); got "
                             f"{self.lora_dropout}")
        if not self.lora_targets or not all(isinstance(t, str) and t for t in self.lora_targets):
            raise TrainError(f"lora_targets must name one or more module names (e.g. {', '.join(LORA_TARGETS[:2])}); "
                             f"got {brief(self.lora_targets)}")
        if self.max_grad_norm < 0:
            raise TrainError(f"max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.overwrite and self.resume is not None:
            raise TrainError("resume and overwrite contradict each other: continue the run in output_dir, or delete it")
        if self.router_lr is not None and not self.router_lr > 0:
            raise TrainError(f"router_lr must be > 0, got {self.router_lr}")
        keeps = self.reduce_keep if isinstance(self.reduce_keep, (list, tuple)) else [self.reduce_keep]
        if self.reduce_keep is not None and (not keeps or any(
                isinstance(k, bool) or not isinstance(k, (int, float)) or not 0.0 < k <= 1.0 for k in keeps)):
            raise TrainError(f"reduce_keep is the fraction of vision tokens kept, in (0, 1] (or a list of them); "
                             f"got {brief(self.reduce_keep)}")
        if isinstance(self.reduce_keep, (list, tuple)) and len(self.reduce_keep) != len(self.capacities or []):
            raise TrainError(f"reduce_keep: a list of {len(self.reduce_keep)} keeps pairs each with a capacity; give "
                             f"`capacities` as long (got {len(self.capacities or [])}), or one keep")
        if self.reduce_scoring not in (None, *REDUCE_SCORINGS, "query"):
            raise TrainError(f"reduce_scoring must be one of {', '.join(REDUCE_SCORINGS)} or query; "
                             f"got {brief(self.reduce_scoring)}")
        if (self.reduce_scoring == "query") != (self.reduce_scorer is not None):
            raise TrainError("reduce_scoring: query ranks by a fitted scorer: give reduce_scorer (its folder) with it, "
                             "and only with it")
        if not 0.0 <= self.reduce_contextual < 1.0:
            raise TrainError(f"reduce_contextual is the share of the kept slots that are merged, in [0, 1); "
                             f"got {brief(self.reduce_contextual)}")
        if isinstance(self.reduce_pool, bool) or not isinstance(self.reduce_pool, int) or self.reduce_pool < 1:
            raise TrainError(f"reduce_pool is the side of the square of tokens averaged into one, a whole number >= 1; "
                             f"got {brief(self.reduce_pool)}")
        if self.reduce_pool > 1 and self.reduce_keep is not None and any(k > 1 / self.reduce_pool**2 for k in keeps):
            raise TrainError(f"reduce_keep {brief(self.reduce_keep)}: pooling {self.reduce_pool} x {self.reduce_pool} "
                             f"leaves 1/{self.reduce_pool ** 2} of the vision tokens; give keeps <= "
                             f"{1 / self.reduce_pool ** 2:g}")
        if self.reduce_pool > 1 and self.reduce_contextual > 0:
            raise TrainError("reduce_contextual and reduce_pool are two ways of merging the tokens: give one of them")
        if not isinstance(self.reduce_merge, bool):
            raise TrainError(f"reduce_merge is true or false; got {brief(self.reduce_merge)}")
        if self.reduce_merge and (self.reduce_pool > 1 or self.reduce_contextual > 0):
            raise TrainError("reduce_merge, reduce_pool and reduce_contextual are each a way of merging the tokens: "
                             "give one of them")
        if self.reduce_scoring is not None and self.reduce_keep is None:
            raise TrainError("reduce_scoring is set but reduce_keep is not: give the fraction of vision tokens to keep")
        if self.mod is not None:
            if self.aux_loss is not None or self.aux_loss_weight is not None:
                raise TrainError("set aux_loss / aux_loss_weight inside `mod:` when the run converts the model")
            self.mod_config()

    def mod_config(self) -> MoDConfig:
        """The MoDConfig of `mod:`, with its errors as config errors."""
        assert self.mod is not None
        if str(self.mod.get("layers", "")).startswith("arank"):
            raise TrainError(
                "mod.layers: ARank layer choice needs calibration; convert first with `vlmod convert "
                "--layers arank:N --calib-data ...` and fine-tune the converted checkpoint"
            )
        try:
            return MoDConfig.from_dict(dict(self.mod))
        except (TypeError, ValueError) as e:
            raise TrainError(f"mod: {e}") from None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Settings as read from YAML: unknown keys, missing ones and values of the wrong type are
        errors that name the key (YAML reads `2e-5` as a string, for one)."""
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(types))
        if unknown:
            raise TrainError(f"unknown finetune setting(s) {unknown}; valid keys: {', '.join(sorted(types))}")
        missing = [k for k in ("model", "data", "output_dir") if d.get(k) in (None, "")]
        if missing:
            raise TrainError(f"missing required setting(s) {missing} (in the YAML or as --{missing[0].replace('_', '-')})")
        return cls(**{k: _typed(k, v, types[k]) for k, v in d.items()})

    @classmethod
    def from_yaml(cls, path: str | Path | None, **overrides: Any) -> TrainConfig:
        """The settings of the YAML at `path` (None: none) with `overrides` on top; an override that
        is None leaves the YAML's value (a flag that was not given)."""
        settings = read_yaml_mapping(path, TrainError) if path else {}
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(settings)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _typed(key: str, value: Any, annotation: str) -> Any:
    """`value` as the type `annotation` names (int, float, bool, str, list, dict; a union such as
    `float | list[float] | None` takes the first that fits)."""
    if value is None and "None" in annotation:
        return None
    for alternative in annotation.split("|"):
        base = alternative.strip().split("[")[0]
        try:
            if base == "float" and not isinstance(value, bool):
                return float(value)
            if base == "int" and not isinstance(value, bool) and float(value) == int(float(value)):
                return int(float(value))
            if base == "bool" and isinstance(value, bool):
                return value
            if base == "str" and isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
            if base == "list" and isinstance(value, (list, tuple, str)):
                return [value] if isinstance(value, str) else list(value)
            if base == "dict" and isinstance(value, dict):
                return value
        except (TypeError, ValueError):
            pass
    raise TrainError(f"{key} must be {annotation.replace(' | None', ' or empty')}, got {brief(value)}")


__all__ = [
    "LORA_TARGETS",
    "LR",
    "PRECISIONS",
    "ROUTER_ONLY_LR",
    "SCHEDULERS",
    "TRACKERS",
    "TRAINABLE",
    "TrainConfig",
]
