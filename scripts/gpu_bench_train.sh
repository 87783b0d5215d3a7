#!/usr/bin/env bash
# The training-step rows of docs/gpu.md: `vlmod bench train` on the real 7B shapes in bfloat16
# (random weights, LoRA and router-only fine-tunes; a full fine-tune's float32 AdamW state of a 7B
# does not fit one 80 GB GPU), dense and MoD steps interleaved in one process each, then the
# CUDA tests. Writes one JSON per row and the log to OUT_DIR.
#
#   bash scripts/gpu_bench_train.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_bench_train.sh OUT_DIR}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

train() {  # name, then the bench train arguments
  local name=$1; shift
  echo "== $name: vlmod bench train $*"
  timeout 150 "$py" -m vlmod bench train "$@" --device cuda --dtype bfloat16 --warmup 2 --repeats 5 \
    --no-progress --json "$out/$name.json"
}
train video-lora-c02-b1 --preset llava-next-video-7b-full --trainable lora --capacity 0.2 --batch-size 1
train video-lora-c02-b4 --preset llava-next-video-7b-full --trainable lora --capacity 0.2 --batch-size 4
train video-lora-c02-b6 --preset llava-next-video-7b-full --trainable lora --capacity 0.2 --batch-size 6
train video-lora-c02-b8-ckpt --preset llava-next-video-7b-full --trainable lora --capacity 0.2 --batch-size 8 \
  --gradient-checkpointing
train video-lora-c05-b4 --preset llava-next-video-7b-full --trainable lora --capacity 0.5 --batch-size 4
train video-router-c02-b4 --preset llava-next-video-7b-full --trainable router --capacity 0.2 --batch-size 4
train llava-lora-c02-b4 --preset llava-1.5-7b-full --trainable lora --capacity 0.2 --batch-size 4
train llava-lora-c05-b4 --preset llava-1.5-7b-full --trainable lora --capacity 0.5 --batch-size 4

timeout 120 "$py" -m pytest -q -p no:cacheprovider -o pythonpath=tests tests/gpu
