#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/gpu.md, in one go: the CUDA tests, then LLaVA-1.5-7B and
# LLaVA-NeXT-Video-7B (the real shapes, random bfloat16 weights built on the GPU) and a
# ViT-L/14-336 tower, dense and MoD in one process each. Writes one JSON per benchmark and a log.
#
#   bash scripts/gpu_bench.sh OUT_DIR [CLIP.mp4]
#
# CLIP: a clip of at least 32 frames for the video rows (default: one generated with PyAV).
set -uo pipefail
out=${1:?usage: gpu_bench.sh OUT_DIR [CLIP.mp4]}
clip=${2:-}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -z "$clip" ]; then
  clip="$out/clip.mp4"
  "$py" -c "from vlmod.bench.inputs import synthetic_clip; synthetic_clip('$clip', seconds=8.0, fps=10)" || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

"$py" -m pytest -q -p no:cacheprovider -o pythonpath=tests tests/gpu

bench() {  # name, then the bench arguments
  local name=$1; shift
  echo "== $name: vlmod bench $*"
  timeout 300 "$py" -m vlmod bench "$@" --device cuda --no-progress --json "$out/$name.json"
}
bench llava-b1 llava --preset llava-1.5-7b-full --batch-size 1 --warmup 2 --repeats 5
bench llava-b8 llava --preset llava-1.5-7b-full --batch-size 8 --warmup 2 --repeats 5
bench llava-b1-cap1 llava --preset llava-1.5-7b-full --capacity 1.0 --batch-size 1 --warmup 2 --repeats 5
bench video-f8-b1 video --preset llava-next-video-7b-full --video "$clip" --frames 8 --batch-size 1 --warmup 2 --repeats 5
bench video-f32-b1 video --preset llava-next-video-7b-full --video "$clip" --frames 32 --batch-size 1 --warmup 2 --repeats 5
bench video-f32-b8 video --preset llava-next-video-7b-full --video "$clip" --frames 32 --batch-size 8 --warmup 1 --repeats 3
bench vit-l336 vit --model vit_large_patch14_clip_336 --dtype bfloat16 --batch-size 64 --capacity 0.5
