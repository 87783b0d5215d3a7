#!/usr/bin/env python
"""Where a dense and a MoD fine-tuning step spend their time: `vlmod bench train`'s pair (a preset
with random weights, the same batch) under torch.profiler, after warm-up steps. Per model: the
step's wall time, the device's busy time (the sum of its kernels: on a GPU, a step whose wall time
is far above it waits for the host), kernels launched, host syncs, and the ops that take the most
device and host time.

    python scripts/profile_train_step.py --preset llava-next-video-7b-full --trainable lora \
        --capacity 0.2 --batch-size 4 --device cuda --dtype bfloat16
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from vlmod.cli.argtypes import HelpFormatter

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
            "aten::_local_scalar_dense", "aten::nonzero")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="llava-next-video-7b-full", help="a bench train preset (default: %(default)s)")
    parser.add_argument("--trainable", default="lora", choices=("full", "lora", "router"), help="(default: %(default)s)")
    parser.add_argument("--capacity", type=float, default=0.2, help="MoD capacity (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="(default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="frozen weights' dtype (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps of each model (default: %(default)s)")
    parser.add_argument("--top", type=int, default=12, help="ops listed per table (default: %(default)s)")
    args = parser.parse_args()

    from vlmod.bench import train
    from vlmod.bench.generation import build_pair
    from vlmod.bench.inputs import on_device
    from vlmod.bench.timing import synchronize

    video = train._is_video(None, args.preset)
    torch.manual_seed(0)
    default_layers = train.default_video_layers if video else train.DEFAULT_LAYERS
    dense, mod, processor, words, _ = build_pair(None, args.preset, train.TRAIN_PRESETS, args.capacity, None,
                                                 default_layers, device=args.device, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        size = dense.config.vision_config.image_size
        batch = on_device(train.synthetic_batch(processor, size, args.batch_size, words, video, Path(tmp)), dense)
    dense_mode = train.DENSE_TRAINABLE[args.trainable][0]
    lora = args.trainable == "lora"
    device = torch.device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    frozen = next(dense.parameters()).dtype  # dense and MoD share their weights: read it before either trains
    for name, model, mode in (("dense", dense, dense_mode), ("MoD", mod, args.trainable)):
        model, optimizer, _ = train.prepare_training(model, mode, lora, False, 0)
        autocast = None if frozen == torch.float32 else frozen
        step = train.TrainingStep(model, batch, optimizer, autocast)
        for _ in range(3):
            step()
        synchronize(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            synchronize(device)
        wall = (time.perf_counter() - start) / args.steps * 1e3
        events = prof.key_averages()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / args.steps / 1e3  # us -> ms
        syncs = {e.key: e.count // args.steps for e in events if e.key in SYNC_OPS}
        print(f"\n===== {name}: {wall:.1f} ms a step (profiled), device busy {busy:.1f} ms, "
              f"{len(kernels) // args.steps} kernels a step, host-side sync/copy calls a step {syncs}")
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
        if device.type == "cuda":
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
        model.to("meta")  # free the device for the next model
        del model, optimizer, step
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
