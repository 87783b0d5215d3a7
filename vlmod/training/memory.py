"""What a fine-tuning run will hold in memory, estimated before it starts, and the refusal of a
run that cannot fit (one line that says how much it needs), instead of the kernel's OOM killer
an hour in.

The estimate counts, per process:
- the frozen weights in their own dtype (a bfloat16 7B: 13.5 GB, mapped from the checkpoint);
- every trainable parameter in float32 four times over: the master weight, its gradient and
  AdamW's two moments (16 bytes a parameter: a full fine-tune of a 7B needs about 108 GB);
- the activations autograd keeps for the backward pass, from the language model's shape and the
  tokens of a micro-batch: per token and layer what autograd saves of attention and a gated MLP
  (10 x width + 4 x MLP width values: the projections' inputs and outputs, the activation and its
  product; plus the attention scores under eager attention), the float32 input each RMSNorm keeps
  when it upcasts (2 x 4 x width bytes) and, at a MoD layer, the float32 input of its router
  (4 x width bytes); or only the layer input under gradient checkpointing (plus one layer
  recomputed); the logits and their gradient in float32, at the positions the LM head runs on
  (the answer positions, `vlmod.training.logits`). Counted with saved-tensor hooks on a
  LLaVA of Llama's MLP ratio in bfloat16: a full fine-tune saves 47.4 x width bytes per token and
  layer dense and 52.0 at MoD layers (capacity 1.0), LoRA and router fine-tunes 35.6 to 38.1; the
  formula gives 49.5 and 53.5 (the old 8 x width + 3 x MLP width gave 40.1, 2 GiB under a 7B
  video fine-tune). MoD layers are counted at every token (an upper bound: they keep fewer);
- what the process already holds besides the model (Python, torch, the data);
- headroom (`headroom`), for what no formula sees, by device. On a GPU: AdamW's foreach
  temporaries (two float32 copies of the trainable weights during a step: torch picks foreach for
  CUDA tensors only), 1.5 GiB for the allocator's cached blocks and transient buffers, and 10% of
  everything but the frozen weights. On a CPU: 0.5 GiB (the C heap's freed but kept blocks) and
  10% of everything, the frozen weights included (resident pages there). The CPU rule was set
  against measured peaks (docs/finetune.md): a full fine-tune of a 214M-parameter LLaVA (width
  2048) peaked at 4.21 GiB, estimated 4.5 (the GPU rule: 7.1); two FSDP2 processes at 3.16 and
  3.21 GiB, planned 3.16; the 7B router, LoRA and video router fine-tunes (docs/results.md, Real size)
  recomputed at 18.8, 17.1 and 22.2 GiB against 17.7, 17.0 and 21.5. An estimate should err
  high: a run killed an hour in costs more than a refusal, which `VLMOD_SKIP_MEMORY_CHECK=1`
  overrides.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmod.api import mod_layers

GIB = 1024**3
HEADROOM = 3 * GIB // 2  # see the module doc: measured, not derived
HEADROOM_CPU = GIB // 2


@dataclass(frozen=True)
class MemoryEstimate:
    frozen_weights: int
    trainable_state: int
    activations: int
    process: int = 0  # what the process holds besides the model: interpreter, libraries, data
    headroom: int = 0  # optimizer temporaries and what the allocator holds beyond the formula

    @property
    def total(self) -> int:
        return self.frozen_weights + self.trainable_state + self.activations + self.process + self.headroom

    def describe(self) -> str:
        return (
            f"{self.total / GIB:.1f} GiB (frozen weights {self.frozen_weights / GIB:.1f}, trainable weights with "
            f"gradients and optimizer state {self.trainable_state / GIB:.1f}, activations {self.activations / GIB:.1f}, "
            f"the process itself {self.process / GIB:.1f}, headroom {self.headroom / GIB:.1f})"
        )


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def estimate(
    model: nn.Module, tokens: int, *, longest: int, compute_dtype: torch.dtype, gradient_checkpointing: bool,
    logit_rows: int | None = None,
) -> MemoryEstimate:
    """Bytes a training step of `model` (trainable parameters marked) holds for a micro-batch of
    `tokens` tokens whose longest row is `longest`, activations in `compute_dtype`, the LM head
    on `logit_rows` positions (None: every token)."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = _text_config(model)
    width = int(getattr(text, "hidden_size", 0) or 0)
    mlp = int(getattr(text, "intermediate_size", 0) or 4 * width)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    eager = getattr(text, "_attn_implementation", None) == "eager"
    size = torch.finfo(compute_dtype).bits // 8
    per_layer = tokens * (size * (10 * width + 4 * mlp + (heads * longest if eager else 0)) + 8 * width)
    routed = len([key for key in mod_layers(model) if key[0] == "language"])
    if gradient_checkpointing:
        activations = layers * tokens * size * width + per_layer + 4 * width * tokens
    else:
        activations = layers * per_layer + routed * 4 * width * tokens
    activations += 2 * (tokens if logit_rows is None else logit_rows) * vocab * 4  # float32 logits and their gradient
    device = next(model.parameters()).device
    process = process_bytes(device)
    return MemoryEstimate(
        frozen, 16 * trainable, activations, process,
        headroom(trainable, 16 * trainable + activations + process, frozen, device.type),
    )


def headroom(trainable: int, body: int, frozen: int, device_type: str) -> int:
    """The margin over the formula (see the module doc) for `trainable` parameters, `body` bytes of
    trainable state, activations and process, and `frozen` bytes of frozen weights on a device of
    `device_type` ("cuda": AdamW's foreach temporaries, 1.5 GiB and 10% of `body`; otherwise
    0.5 GiB and 10% of everything)."""
    if device_type == "cuda":
        return 8 * trainable + HEADROOM + body // 10
    return HEADROOM_CPU + (body + frozen) // 10


def process_bytes(device: torch.device) -> int:
    """This process's own anonymous memory on CPU (the model's mapped weights are file pages, not
    counted here); nothing on a GPU, whose free memory is measured as it is."""
    if device.type != "cpu":
        return 0
    return _meminfo(Path("/proc/self/status")).get("RssAnon", 0)


def available_bytes(device: torch.device) -> int:
    """Memory this process can still use on `device`, counting what it already holds: a GPU's
    free plus allocated bytes; on CPU, MemAvailable (reclaimable page cache included, so the
    mapped checkpoint counts as available too) plus this process's own anonymous memory, capped
    by a cgroup limit."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    info = _meminfo(Path("/proc/meminfo"))
    own = _meminfo(Path("/proc/self/status")).get("RssAnon", 0)
    if "MemAvailable" not in info:  # not Linux: nothing to go by
        return 1 << 62
    available = info["MemAvailable"] + own
    limit = _cgroup_limit()
    return min(available, limit) if limit else available


def _meminfo(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024
    return values


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def check_fits(needed: MemoryEstimate, device: torch.device, error: type[Exception], plan: str = "") -> None:
    """`error` (one line: what it needs, what is free, what to change, and `plan`: what it needs
    per GPU on more of them, `describe_plan`) when the estimate exceeds what `device` has;
    VLMOD_SKIP_MEMORY_CHECK=1 turns the check off (an estimate can be wrong)."""
    if os.environ.get("VLMOD_SKIP_MEMORY_CHECK") == "1":
        return
    have = available_bytes(device)
    if needed.total > have:
        raise error(
            f"this fine-tune needs about {needed.describe()}, but {device.type} has {have / GIB:.1f} GiB free; "
            "train less (trainable: router or lora), turn on gradient_checkpointing, lower batch_size, or use a "
            f"machine with more memory (VLMOD_SKIP_MEMORY_CHECK=1 runs it anyway){'; ' + plan if plan else ''}"
        )


GPU_COUNTS = (1, 2, 4, 8)
ENGINES = ("DDP", "FSDP2", "ZeRO-3", "FSDP2 offload", "ZeRO-3 offload")


def plan(
    needed: MemoryEstimate, unit_bytes: int, gpus: tuple[int, ...] = GPU_COUNTS, device_type: str = "cuda"
) -> dict[str, dict[int, int]]:
    """Bytes per GPU of the run `needed` estimates for one process, on each count of `gpus` under
    each of `ENGINES` (batch_size per process, as the config says). From the same terms:
    - DDP: everything on every GPU, and past one GPU a gradient bucket per trainable parameter
      (4 bytes: DDP's buckets are a second copy of the gradients);
    - FSDP2 / ZeRO-3 (full sharding): frozen weights and the trainable state split over the GPUs,
      the activations whole (a process's own micro-batch), plus the gathered layers: `unit_bytes`
      (the largest shard unit's whole weights) three times, the one running, the one prefetched
      and the running one's gradients; ZeRO-3's prefetch buckets are counted as FSDP2's units;
    - offload: the weights and the trainable state on the host (the plan's CPU column is not
      shown), the GPU holding activations and gathered layers;
    and the headroom of the one-process estimate, from what each GPU holds of it (`headroom`). The
    process's own host memory is not a GPU's, so it is left out; `device_type` "cpu" plans
    processes on a CPU instead (gloo, as tests/training/test_sharded.py runs them): each holds its
    own process memory too, with the CPU's headroom."""
    trainable = needed.trainable_state // 16
    acts = needed.activations
    process = needed.process if device_type == "cpu" else 0

    def gpu(frozen: int, params: int, extra: int) -> int:
        body = 16 * params + acts + process
        return frozen + body + extra + headroom(params, body, frozen, device_type)

    out: dict[str, dict[int, int]] = {e: {} for e in ENGINES}
    for n in gpus:
        gathered = 3 * unit_bytes if n > 1 else 0
        out["DDP"][n] = gpu(needed.frozen_weights, trainable, 4 * trainable if n > 1 else 0)
        out["FSDP2"][n] = out["ZeRO-3"][n] = gpu(needed.frozen_weights // n, -(-trainable // n), gathered)
        offload = acts + 3 * unit_bytes + process + headroom(0, acts + process, 0, device_type)
        out["FSDP2 offload"][n] = out["ZeRO-3 offload"][n] = offload
    return out


def describe_plan(table: dict[str, dict[int, int]]) -> str:
    """One line: per GPU on each count, under each engine ("DDP 1/2/4/8 GPUs: 120/124/124/124 GiB")."""
    counts = next(iter(table.values())).keys()
    return "per GPU on " + "/".join(map(str, counts)) + " GPUs: " + ", ".join(
        f"{engine} " + "/".join(f"{b / GIB:.0f}" if b >= 10 * GIB else f"{b / GIB:.1f}" for b in row.values())
        for engine, row in table.items()
    ) + " GiB"


__all__ = [
    "ENGINES", "GPU_COUNTS", "MemoryEstimate", "available_bytes", "check_fits", "describe_plan", "estimate", "headroom",
    "plan", "process_bytes",
]


def release_memory() -> None:
    """Give the memory of a finished request back to the system: collect cycles, then ask glibc to
    return its freed arenas (without this a server that decoded a few large pictures keeps their
    peak as resident memory)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
