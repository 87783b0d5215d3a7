"""Checkpoints: `accelerator.save_state` every `save_steps` optimizer steps into
`output_dir/checkpoints/step-N` (written as `step-N.tmp`, then renamed), with `trainer_state.json`
holding the step, epoch and batch position; `resume: latest` (or a checkpoint path) continues at
that step with the same optimizer, scheduler, RNG and data order. `latest` skips a damaged
checkpoint for the newest intact one and says so.

A run owns its output folder (`run.json` holds its settings): a folder holding another run's
checkpoints is refused unless `resume` continues that run (only with the same settings; the ones
that differ are named) or `overwrite` deletes it first. Without that, checkpoint rotation would
sort both runs' checkpoints together and delete the new run's as they are written. The shuffle order of an epoch is
a function of (seed, epoch), so a resumed run sees exactly the batches the original would have.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vlmod.errors import TrainError
from vlmod.io.files import folder_written, write_json
from vlmod.io.safetensors_layout import align_folder
from vlmod.training.merge import merge_lora_mapped, merged_lora_state_dict, save_adapter
from vlmod.training.resume import DATA_KEY, data_fingerprint, settings_diff

if TYPE_CHECKING:
    from vlmod.training.config import TrainConfig

STATE_FILE = "trainer_state.json"
RUN_FILE = "run.json"
# Settings that do not change what a run computes: a resumed run may change these freely.
FREE_SETTINGS = frozenset({
    "output_dir", "resume", "overwrite", "save_steps", "save_total_limit", "eval_steps", "log_steps", "report_to",
    "num_workers", "cache_data", "strict", "val_data", "gradient_checkpointing",
})


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _step_of(path: Path) -> int | None:
    number = path.name.removeprefix("step-")
    return int(number) if path.name.startswith("step-") and number.isdigit() else None


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under `output_dir/checkpoints` (named step-N, with a state file),
    newest first."""
    root = checkpoint_dir(output_dir)
    found = [p for p in root.iterdir() if _step_of(p) is not None and (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: _step_of(p) or 0, reverse=True)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step under `output_dir/checkpoints` (complete ones only)."""
    found = checkpoints(output_dir)
    return found[0] if found else None


class DamagedCheckpoint(Exception):
    """A checkpoint whose files cannot be read back; `resume: latest` falls back past it."""


def run_settings(cfg: TrainConfig) -> dict[str, Any]:
    """What makes two runs the same run: every setting but FREE_SETTINGS, local paths absolute,
    as JSON would give it back (so a saved copy compares equal)."""
    d = cfg.to_dict()
    for key in ("model", "data", "image_root"):
        if d.get(key) and Path(d[key]).expanduser().exists():
            d[key] = str(Path(d[key]).expanduser().resolve())
    d[DATA_KEY] = data_fingerprint(cfg.data)  # the same path with other content is other data
    return json.loads(json.dumps({k: v for k, v in d.items() if k not in FREE_SETTINGS}))


def _read_json(path: Path) -> Any:
    """The JSON in `path`; DamagedCheckpoint naming the file when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(f"{path} is unreadable ({str(e).splitlines()[0][:120]})") from None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of `checkpoint`: step, epoch, batch position, and the run's settings."""
    state = _read_json(checkpoint / STATE_FILE)
    if not isinstance(state, dict) or not all(
        isinstance(state.get(k), int) and state[k] >= 0 for k in ("step", "epoch", "batch_in_epoch")
    ):
        raise DamagedCheckpoint(f"{checkpoint / STATE_FILE} lacks a valid step, epoch and batch_in_epoch")
    return state


def _saved_run(output_dir: Path) -> dict[str, Any] | None:
    """The settings in `output_dir/run.json`; None when there is none, {} when it is unreadable."""
    path = output_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = _read_json(path)
    except DamagedCheckpoint:
        return {}
    return data.get("settings", {}) if isinstance(data, dict) else {}


def check_output_dir_owner(cfg: TrainConfig) -> None:
    """Refuse an output folder that cannot be written, or that holds another run's checkpoints
    when neither `resume` nor `overwrite` says what to do with them (see the module doc). Nothing
    is written: called before the model loads."""
    from vlmod.io.paths import check_output_dir

    out = check_output_dir(
        cfg.output_dir, "output_dir", inputs=[cfg.model, cfg.data, cfg.val_data], error=TrainError,
        replaces=cfg.overwrite,
    )
    # The final model replaces output_dir/model: never the model this run starts from.
    check_output_dir(out / "model", "output_dir", inputs=[cfg.model], error=TrainError, replaces=True)
    if cfg.overwrite or cfg.resume is not None:
        return
    root = checkpoint_dir(out)
    found = sorted(p.name for p in root.iterdir() if _step_of(p) is not None) if root.is_dir() else []
    if not found:
        return
    saved = _saved_run(out)
    differ = settings_diff(saved, run_settings(cfg)) if saved else []
    what = "a run with these settings" if saved and not differ else "another run"
    raise TrainError(
        f"output_dir {out} already holds the checkpoints of {what} ({', '.join(found[:4])}"
        f"{', ...' if len(found) > 4 else ''}){'; its settings differ: ' + '; '.join(differ[:4]) if differ else ''}. "
        "Pass --resume latest to continue it, --overwrite to delete it and start over, or choose another --output-dir"
    )


def clear_output_dir(out: Path) -> None:
    """What an earlier run wrote into `out` (and nothing else): `overwrite`."""
    for name in ("checkpoints", "model", "model.tmp", "logs", "train_log.json", RUN_FILE):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def resolve_resume(cfg: TrainConfig) -> list[Path]:
    """The checkpoints `resume` may continue from, best first (`latest`: every complete one,
    newest first, for the fallback past damaged ones). Errors when there is none, or when the run
    that wrote them had other settings. Reads only small JSON files: called before the model loads."""
    if cfg.resume is None:
        return []
    if cfg.resume == "latest":
        found = checkpoints(cfg.output_dir)
        if not found:
            raise TrainError(f"resume: latest, but {checkpoint_dir(cfg.output_dir)} holds no complete checkpoint")
    else:
        path = Path(cfg.resume).expanduser()
        if not (path / STATE_FILE).is_file():
            raise TrainError(f"resume: {cfg.resume} is not a checkpoint of this trainer (no {STATE_FILE})")
        found = [path]
    current = run_settings(cfg)
    for path in found:
        try:
            state = read_state(path)
        except DamagedCheckpoint:
            continue  # reported when it is tried
        saved = state.get("run") or _saved_run(path.parent.parent)
        differ = settings_diff(saved, current) if saved else []
        if differ:
            raise TrainError(
                f"resume: {path} belongs to a run with other settings ({'; '.join(differ[:6])}). Resume with the "
                "same settings, or start over with --overwrite (or another --output-dir)"
            )
        break
    return found


def _damaged_file(checkpoint: Path) -> str:
    """The first file of `checkpoint` that does not read back (for the error message)."""
    for path in sorted(checkpoint.iterdir()):
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        f.get_tensor(key)
            elif path.suffix in (".bin", ".pt", ".pth", ".pkl"):
                torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any failure to read it back is the answer
            return f"{path.name}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
    return "no single file is unreadable"


def load_checkpoint(accelerator: Any, checkpoint: Path) -> dict[str, Any]:
    """`accelerator.load_state` of `checkpoint` and its trainer state; DamagedCheckpoint naming the
    file that does not read back. A random state accelerate cannot restore (it only logs that at
    INFO level and goes on) is reported as a warning: dropout then differs from the original run."""
    import logging

    state = read_state(checkpoint)
    messages: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log = logging.getLogger("accelerate.checkpointing")
    handler, level = _Catch(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        accelerator.load_state(str(checkpoint))
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - whatever a damaged file raises (SafetensorError, UnpicklingError, ...)
        raise DamagedCheckpoint(f"checkpoint {checkpoint} is damaged ({_damaged_file(checkpoint)})") from None
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    if any("Could not load random states" in m for m in messages):
        accelerator.print(
            f"warning: the random state in {checkpoint} could not be restored (random_states_*.pkl is damaged or "
            "from another version); the data order is kept, but dropout and other random draws differ from the original run"
        )
    return state


def save_checkpoint(accelerator: Any, cfg: TrainConfig, state: dict[str, Any]) -> Path:
    """`save_state` to step-N.tmp, then rename: a crash mid-save never leaves a checkpoint that
    `resume: latest` would pick up half-written."""
    root = checkpoint_dir(cfg.output_dir)
    final = root / f"step-{state['step']}"
    tmp = root / f"step-{state['step']}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    from safetensors import SafetensorError

    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_json(tmp / STATE_FILE, {**state, "run": run_settings(cfg)})
    except (OSError, SafetensorError) as e:  # a full disk: the half-written step is removed, the older ones kept
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        kept = latest_checkpoint(cfg.output_dir)
        then = f"then continue with --resume latest (checkpoint {kept.name} is kept)" if kept else "then run again"
        raise TrainError(
            f"could not save checkpoint {final.name} to {root}: {reason}; free space or fix the folder's permissions, "
            f"{then}"
        ) from None
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if cfg.save_total_limit:
            done = sorted((p for p in root.iterdir() if _step_of(p) is not None), key=lambda p: _step_of(p) or 0)
            for old in done[: -cfg.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def keep_used_key_conversions(model: nn.Module) -> None:
    """Keep for saving only the key conversions the checkpoint's load used, as transformers 5.24's
    plain load does; its DeepSpeed ZeRO-3 load keeps every one, and the reverse of one that never
    applied (the CLIP tower's `PrefixChange`) rewrote every saved key ("language_model.model.model.
    embed_tokens"), a folder that loads with no weights at all."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions and all(hasattr(c, "was_used") for c in conversions):
        model._weight_conversions = [c for c in conversions if c.was_used()]


def weights_gathered(accelerator: Any) -> bool:
    """Whether the model's parameters are shards whose whole values only the gathered state dict
    holds (FSDP2, DeepSpeed ZeRO-3): LoRA is then merged from that state dict, not the model."""
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    zero3 = accelerator.distributed_type.value == "DEEPSPEED" and ds is not None and ds.zero_stage == 3
    return bool(getattr(accelerator, "is_fsdp2", False)) or zero3


def save_model(accelerator: Any, model: nn.Module, processor: Any, out: Path, dtype: torch.dtype | None = None) -> Path:
    """The trained model as `save_pretrained` writes it (the full state dict gathered under FSDP /
    ZeRO-3; LoRA merged into the weights, a group of projections at a time: `merge_lora_mapped`,
    or from the gathered state dict: `merged_lora_state_dict`; the adapters also saved as adapters
    beside it, in `out`'s sibling `adapter`: `save_adapter`),
    plus the processor, to `out` via a temporary dir. `dtype`: the gathered weights cast to it
    first (a sharded run's trained shards are float32 master weights that `cast_trainable` cannot
    reach; one process casts its model before saving, and merges LoRA after that cast too)."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process and dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(model)
        from safetensors import SafetensorError

        from vlmod.io.safetensors_layout import damaged_safetensors

        scratch = out.with_name(out.name + ".merge.tmp")  # merged LoRA projections, mapped while saving
        try:
            with folder_written(out) as tmp:  # `out` complete or absent
                if hasattr(model, "peft_config"):
                    save_adapter(model, state_dict, out.with_name("adapter"))  # before the merge changes the model
                if hasattr(model, "peft_config") and weights_gathered(accelerator):
                    model, state_dict = model.get_base_model(), merged_lora_state_dict(model, state_dict)
                elif hasattr(model, "peft_config"):
                    model, state_dict = merge_lora_mapped(model, scratch), None
                keep_used_key_conversions(model)
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                align_folder(tmp)  # loading maps the weights and computes what was saved, bit for bit
                processor.save_pretrained(tmp)
                short = damaged_safetensors(tmp)  # a full disk can leave a short file without an error
                if short:
                    raise OSError(f"{short} (is the disk full?)")
        except (OSError, SafetensorError) as e:
            reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
            kept = latest_checkpoint(out.parent)
            then = (
                f"then continue with --resume latest (checkpoint {kept.name} is kept)" if kept else
                "then run again: this run saved no checkpoint to resume from (save_steps 0; set it to keep some)"
            )
            raise TrainError(
                f"could not save the model to {out}: {reason}; free space or fix the folder's permissions, {then}"
            ) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    accelerator.wait_for_everyone()
    return out
