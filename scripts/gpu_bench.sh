#!/usr/bin/env bash
# The GPU rows of docs/gpu.md in one go, eager and compiled: LLaVA-1.5-7B and LLaVA-NeXT-Video-7B
# (the real shapes, random bfloat16 weights built on the GPU), dense and MoD in one process per
# row, SDPA trying flash before cuDNN; then LoRA training steps, a full fine-tune of a tiny MoD
# model under configs/accelerate/fsdp.yaml and zero3.yaml in one process (Accelerate's GPU path of
# each), and the CUDA tests. One JSON per benchmark row and the log in OUT_DIR; a table of the
# rows at the end (scripts/gpu_table.py).
#
#   bash scripts/gpu_bench.sh OUT_DIR [ROWS]
#
# ROWS: a comma list of row names (default: all) to split the rows over calls of a short lease.
# Environment: WHEELS=DIR installs the wheels there first (--no-deps, into /tmp/vlmod-site: a
# machine with no network, whose transformers is older than vlmod's; made here with
#   pip download "transformers==5.24.0" av --python-version 3.12 --only-binary=:all: --no-deps \
#     --platform manylinux_2_28_x86_64 -d .gpu/wheels
# and carried with the call, .gpu/ being git-ignored locally); CLIP=PATH a clip of 32+
# frames (default: one generated with PyAV); DEVICE (default cuda); LLAVA_PRESET / VIDEO_PRESET
# (default the -full 7B presets; `tiny` runs the script's logic on a CPU in a minute).
set -uo pipefail
out=${1:?usage: gpu_bench.sh OUT_DIR [ROWS]}
rows=${2:-all}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
llava=${LLAVA_PRESET:-llava-1.5-7b-full}
video=${VIDEO_PRESET:-llava-next-video-7b-full}
sdpa=flash,efficient,cudnn,math
if [ -n "${WHEELS:-}" ]; then
  "$py" -m pip install -q --no-deps --no-index --target /tmp/vlmod-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/vlmod-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$device" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
clip=${CLIP:-$out/../clip.mp4}
want() { [ "$rows" = all ] || [[ ",$rows," == *",$1,"* ]]; }

bench() {  # name, seconds, then the bench arguments
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  echo "== $name: vlmod bench $*"
  local start=$SECONDS
  timeout "$limit" "$py" -m vlmod bench "$@" --device "$device" --sdpa-priority "$sdpa" --no-progress \
    --json "$out/$name.json" 2>&1 | grep -v "Warning\|warn(" | tail -25
  echo "-- $name: ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
if want video-f32-b1 || want video-f32-b1-compiled || want video-f8-b1-compiled; then
  [ -f "$clip" ] || "$py" -c "from vlmod.bench.inputs import synthetic_clip; synthetic_clip('$clip', seconds=8.0, fps=10)" || exit 1
fi
gen=(--warmup 1 --repeats 5 --new-tokens 16)
bench llava-b1 150 llava --preset "$llava" --batch-size 1 "${gen[@]}"
bench llava-b1-compiled 300 llava --preset "$llava" --batch-size 1 "${gen[@]}" --compile
bench llava-b1-cap1-compiled 240 llava --preset "$llava" --batch-size 1 --capacity 1.0 "${gen[@]}" --compile
bench video-f32-b1 180 video --preset "$video" --video "$clip" --frames 32 --batch-size 1 "${gen[@]}"
bench video-f32-b1-compiled 300 video --preset "$video" --video "$clip" --frames 32 --batch-size 1 "${gen[@]}" --compile
bench video-f8-b1-compiled 300 video --preset "$video" --video "$clip" --frames 8 --batch-size 1 "${gen[@]}" --compile
train=(--preset "$video" --trainable lora --capacity 0.2 --warmup 2 --repeats 5)
[ "$device" = cuda ] && train+=(--dtype bfloat16)
bench train-lora-c02-b1 150 train "${train[@]}" --batch-size 1
bench train-lora-c02-b4 150 train "${train[@]}" --batch-size 4
sharded() {  # name, accelerate config: a 4-step full fine-tune of a tiny MoD model, one process
  local name=$1 config=$2
  want "$name" || return 0
  if [ "$name" = finetune-zero3 ] && ! "$py" -c "import deepspeed" 2>/dev/null; then
    echo "== $name: skipped (deepspeed is not importable here; carry its wheel in WHEELS)"; return 0
  fi
  echo "== $name: accelerate launch --num_processes 1 --config_file $config scripts/finetune.py"
  local base=$out/sharded start=$SECONDS
  if [ ! -f "$base/mod/config.json" ]; then
    "$py" -m vlmod tiny --out "$base/tiny" >/dev/null &&
      "$py" -m vlmod convert --model "$base/tiny" --out "$base/mod" --capacity 0.5 >/dev/null &&
      "$py" -m vlmod data synthetic --out "$base/data" --train 32 --val 8 >/dev/null || return 0
  fi
  timeout 240 "$py" -m accelerate.commands.launch --num_processes 1 --config_file "$config" scripts/finetune.py \
    --model "$base/mod" --data "$base/data/train.json" --output-dir "$base/$name" --trainable full \
    --max-steps 4 --batch-size 2 --save-steps 2 --no-progress 2>&1 | grep -v "Warning\|warn(" | tail -12
  echo "-- $name: ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
if [ "$device" = cuda ]; then  # Accelerate's real GPU path of the two sharding configs (issue 60)
  sharded finetune-fsdp2 configs/accelerate/fsdp.yaml
  sharded finetune-zero3 configs/accelerate/zero3.yaml
fi
if want tests && [ "$device" = cuda ]; then
  echo "== tests/gpu"
  timeout 180 "$py" -m pytest -q -p no:cacheprovider -o pythonpath=tests tests/gpu 2>&1 | tail -15
fi
"$py" scripts/gpu_table.py "$out"
