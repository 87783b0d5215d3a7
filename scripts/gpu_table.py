"""The rows `scripts/gpu_bench.sh` wrote, as one Markdown table: `python scripts/gpu_table.py OUT_DIR`."""

import json
import sys
from pathlib import Path


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def row(name: str, r: dict) -> str:
    d, m = r["dense"], r["mod"]
    compiled = (r.get("compile") or {}).get("first_call_s")
    first = "-" if not compiled else f"{compiled['dense']:.0f} / {compiled['mod']:.0f} s"
    flag = "yes" if r.get("contended") else "no"
    if r.get("benchmark") == "train":
        return (f"| {name} | step {_ms(d['step_s'])} / {_ms(m['step_s'])} | {_x(r['predicted_step_speedup'])} | "
                f"{_x(r['step_speedup'])} | {r['step_efficiency']:.2f} | - | - | - | {first} | {flag} |")
    e2e = _x(r.get("speedup")) if r.get("benchmark") == "video" else "-"
    return (f"| {name} | {_ms(d['prefill_s'])} / {_ms(m['prefill_s'])} | {_x(r['predicted_speedup'])} | "
            f"{_x(r['prefill_speedup'])} | {r['prefill_efficiency']:.2f} | "
            f"{_ms(d['decode_step_s'])} / {_ms(m['decode_step_s'])} | {_x(r['decode_speedup'])} | {e2e} | {first} | {flag} |")


def main(out: str) -> int:
    print("| row | prefill ms dense / MoD | predicted | measured | efficiency | decode ms/step dense / MoD | "
          "decode speedup | end to end frames/s | compile (first call) | contended |")
    print("|" + "---|" * 10)
    for path in sorted(Path(out).glob("*.json")):
        try:
            print(row(path.stem, json.loads(path.read_text())))
        except (KeyError, TypeError, ValueError) as e:
            print(f"| {path.stem} | unreadable ({e}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
