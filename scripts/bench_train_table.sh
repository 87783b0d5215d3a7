#!/usr/bin/env bash
# The `vlmod bench train` table of docs/speed.md ("Training step"): dense vs MoD fine-tuning steps
# for both presets, full / router / lora, capacity 0.5 and 0.2, gradient checkpointing off and on
# (24 runs, one process each), one JSON per run and a summary table at the end.
#
#   bash scripts/bench_train_table.sh OUT_DIR
#
# Environment: SOURCES (default "--preset llava-1.5;--preset llava-next-video-7b": ';'-separated
# model arguments, e.g. "--model /path/to/llava"), TRAINABLE (default "full router lora"),
# CAPACITIES (default "0.5 0.2"), CHECKPOINTING (default "off on"), THREADS (default 1: on a
# shared CPU one thread is least hurt by other jobs), REPEATS (default 3), WARMUP (default 1),
# EXTRA (more bench arguments, e.g. "--mixed-precision bf16"), PYTHON (default python3).
# On this project's 2-core CPU the whole table took 23 minutes idle with THREADS=2 (a run 31-114 s)
# and 33 minutes at one thread with a one-thread job on the other core (a run 43-150 s).
set -uo pipefail
out=${1:?usage: bench_train_table.sh OUT_DIR}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
IFS=';' read -r -a sources <<< "${SOURCES:---preset llava-1.5;--preset llava-next-video-7b}"
for source in "${sources[@]}"; do
  tag=$(echo "${source##*[ /]}" | tr -c 'A-Za-z0-9.\n-' '_')
  for trainable in ${TRAINABLE:-full router lora}; do
    for capacity in ${CAPACITIES:-0.5 0.2}; do
      for gc in ${CHECKPOINTING:-off on}; do
        flag=""; [ "$gc" = on ] && flag="--gradient-checkpointing"
        name="$tag-$trainable-c$capacity-gc$gc"
        echo "== $name"
        start=$(date +%s)
        # shellcheck disable=SC2086  # source, flag and EXTRA are word lists
        "$py" -m vlmod bench train $source --trainable "$trainable" --capacity "$capacity" $flag \
          --threads "${THREADS:-1}" --warmup "${WARMUP:-1}" --repeats "${REPEATS:-3}" ${EXTRA:-} \
          --no-progress --json "$out/$name.json" > "$out/$name.txt" 2>&1
        echo "   exit $? in $(( $(date +%s) - start )) s"
      done
    done
  done
done
"$py" - "$out" <<'EOF'
import json, sys
from pathlib import Path

def skipped(r):
    share = r.get("skipped_token_share")
    return "-" if share is None else f"{100 * share:.1f}%"


def without(r):
    e = r.get("step_efficiency_without_optimizer")
    return "-" if e is None else f"{e:.3f}"


def mib(n):
    return "-" if n is None else f"{n / 2**20:.0f}"


rows = []
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    d, m = r["dense"], r["mod"]
    peak = "-" if r["peak_memory_change"] is None else f"{100 * r['peak_memory_change']:+.1f}%"
    rows.append(
        f"| {r['model']} | {r['trainable']} | {next(iter(r['mod_layers'].values())):g} | "
        f"{'on' if r['gradient_checkpointing'] else 'off'} | {d['step_s'] * 1e3:.0f} | {m['step_s'] * 1e3:.0f} | "
        f"{r['predicted_step_speedup']:.3f}x | {r['step_speedup']:.3f}x | {r['step_efficiency']:.3f} "
        f"({r['step_efficiency_causal_attention']:.3f}) | "
        f"{without(r)} | "
        f"{mib(d['peak_memory_bytes'])} | {mib(m['peak_memory_bytes'])} | {peak} | "
        f"{skipped(r)} | {'yes' if r['contended'] else 'no'} |"
    )
print("| model | trains | capacity | checkpointing | dense ms | MoD ms | predicted | measured | efficiency "
      "(causal) | efficiency without AdamW | dense peak MiB | MoD peak MiB | peak change | tokens skipped | contended |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
EOF
