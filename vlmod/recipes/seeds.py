"""One table over several seeds of the synthetic recipe (`vlmod recipe --seeds 0,1,2`): per method
and compute point, each seed's accuracy, the mean and the worst seed, and the dense gap (the method
minus dense on the questions both answered, per seed; its mean and worst); per question type the
mean. One seed can be a lucky draw (issue 59: one of twelve video draws learned `order`), so the
worst seed is what a claim must survive.

It reads each seed's results.json only, so finished runs combine too, e.g. after running
`vlmod recipe --seed N --out runs/x/seed-N` by hand: `write_combined("runs/x", ["runs/x/seed-0",
"runs/x/seed-1"])`. The runs must share every setting but the seed (and threads)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmod.errors import InputError
from vlmod.evaluation.evidence import PIPELINE_ONLY
from vlmod.evaluation.frontier import paired_gap, rows_evidence
from vlmod.io.files import write_json, write_text
from vlmod.recipes.reuse import read_record
from vlmod.recipes.settings import with_defaults

RESULTS = "results.json"
_FREE = ("seed", "threads")  # settings that may differ between the runs combined


def read_run(run: str | Path) -> dict[str, Any]:
    """The results.json of one finished recipe run (its folder, or the file), checked enough to combine."""
    path = Path(run).expanduser()
    path = path / RESULTS if path.is_dir() else path
    if not path.is_file():
        raise InputError(f"{path} is missing: that seed's recipe has not finished; run it (or drop it from the seeds)")
    data = read_record(path, ("--seeds", "run that seed's recipe again"), ("settings",))
    rows = data.get("results")
    fine = isinstance(rows, list) and all(
        isinstance(r, dict) and {"method", "target"} <= set(r) and isinstance(r.get("accuracy"), (int, float))
        and isinstance(r.get("accuracy_by_type", {}), dict) for r in rows)
    if not fine or not any(r["method"] == "dense" and "accuracy_by_type" in r for r in rows):
        raise InputError(f"--seeds: {path} is damaged (no dense row in its results); run that seed's recipe again")
    return data


def _key(row: dict[str, Any]) -> tuple[str, float | None]:
    return row["method"], row["target"]


def _types(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean accuracy per question type over the rows that have it."""
    types = sorted({t for r in rows for t in r.get("accuracy_by_type") or {}})
    return {t: sum(v) / len(v) for t in types
            if (v := [r["accuracy_by_type"][t] for r in rows if t in (r.get("accuracy_by_type") or {})])}


def combine(runs: Sequence[str | Path]) -> dict[str, Any]:
    """The combined record of finished recipe runs (folders or results.json files) of one setting
    and distinct seeds: what `format_combined` writes and results.json holds."""
    if not runs:
        raise InputError("--seeds: no runs to combine; give at least one seed")
    records = [read_run(r) for r in runs]
    seeds = [rec["settings"].get("seed") for rec in records]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1}, key=str)
    if repeated:
        raise InputError(f"--seeds: seed {', '.join(map(str, repeated))} comes more than once; combine each seed once")
    first = with_defaults(records[0]["settings"])
    for run, rec in zip(runs[1:], records[1:], strict=True):
        other = with_defaults(rec["settings"])
        changed = sorted(k for k in first.keys() | other.keys() if k not in _FREE and first.get(k) != other.get(k))
        if changed:
            raise InputError(f"--seeds: {run} ran with other {', '.join(changed)} than {runs[0]}; combine runs "
                             "that differ in the seed only")
    keys: list[tuple[str, float | None]] = []
    for rec in records:
        keys += [k for k in map(_key, rec["results"]) if k not in keys]
    rows = []
    denses = [next(r for r in rec["results"] if r["method"] == "dense") for rec in records]
    for method, target in keys:
        found = [next((r for r in rec["results"] if _key(r) == (method, target)), None) for rec in records]
        acc = [None if r is None else r["accuracy"] for r in found]
        gaps = [None if r is None or method == "dense" else _gap(r, d) for r, d in zip(found, denses, strict=True)]
        have = [(a, s) for a, s in zip(acc, seeds, strict=True) if a is not None]
        given = [g for g in gaps if g is not None]
        label = next(r for r in found if r is not None).get("label", method)
        rows.append({
            "method": method, "label": label, "target": target, "accuracy": acc,
            "mean": sum(a for a, _ in have) / len(have), "worst": min(have)[0], "worst_seed": min(have)[1],
            "dense_gap_points": gaps, "dense_gap_mean": sum(given) / len(given) if given else None,
            "dense_gap_worst": min(given) if given else None,
            "accuracy_by_type_mean": _types([r for r in found if r is not None]),
        })
    why = [f"seed {s}: {e.why_not}" for s, rec in zip(seeds, records, strict=True)
           if not (e := rows_evidence(rec["results"])).enough]
    return {"seeds": seeds, "runs": [str(r) for r in runs], "task": first.get("task"),
            "settings": first, "verdict": not why, "no_verdict": "; ".join(why), "results": rows}


def _gap(row: dict[str, Any], dense: dict[str, Any]) -> float:
    """The row minus dense in points, on the questions both answered (paired), else on their own."""
    gap = paired_gap(row, dense)
    return gap[0] if gap is not None else 100 * (row["accuracy"] - dense["accuracy"])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _pts(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def format_combined(combined: dict[str, Any]) -> str:
    """The combined results.md: the no-verdict line where a seed has no verdict, the table of each
    seed, mean and worst with the dense gaps, and the mean per question type."""
    from vlmod.data.synthetic_video import TEMPORAL_TYPES

    seeds, rows = combined["seeds"], combined["results"]
    lines = [] if combined["verdict"] else [f"{PIPELINE_ONLY} ({combined['no_verdict']}).", ""]
    listed = ", ".join(map(str, seeds))
    lines += [f"Accuracy (%) of the {combined['task']} recipe on {len(seeds)} seed{'s' * (len(seeds) > 1)} "
              f"({listed}): each seed, the mean and the worst seed; the dense gap is the method minus dense in "
              "points, on the questions both answered (per seed, its mean and its worst).", ""]
    headers = ["method", "LM FLOPs target", *(f"seed {s}" for s in seeds), "mean", "worst (seed)",
               "dense gap by seed", "gap mean", "gap worst"]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        point = "-" if r["target"] is None else f"/{r['target']:g}"
        gaps = " / ".join(_pts(g) for g in r["dense_gap_points"]) if r["method"] != "dense" else "-"
        cells = [r["label"], point, *map(_pct, r["accuracy"]), _pct(r["mean"]), f"{_pct(r['worst'])} ({r['worst_seed']})",
                 gaps, _pts(r["dense_gap_mean"]), _pts(r["dense_gap_worst"])]
        lines.append("| " + " | ".join(cells) + " |")
    partial = [f"{r['label']} /{r['target']:g}" for r in rows if None in r["accuracy"] and r["target"] is not None]
    if partial:
        lines += ["", "- on some seeds only (out of reach on the others; mean and worst over those that ran): "
                  + ", ".join(partial)]
    temporal = TEMPORAL_TYPES if combined["task"] == "video" else ()
    types = sorted({t for r in rows for t in r["accuracy_by_type_mean"]}, key=lambda t: (t not in temporal, t))
    lines += ["", f"Mean accuracy (%) by question type over the seeds{' (* needs several frames)' * bool(temporal)}:",
              "", "| method | LM FLOPs target | " + " | ".join(f"{t}*" if t in temporal else t for t in types) + " |",
              "|" + "---|" * (len(types) + 2)]
    for r in rows:
        point = "-" if r["target"] is None else f"/{r['target']:g}"
        lines.append(f"| {r['label']} | {point} | "
                     + " | ".join(_pct(r["accuracy_by_type_mean"].get(t)) for t in types) + " |")
    lines += ["", "Each seed's own table, verdicts and stage times: " + ", ".join(f"`{r}/results.md`"
                                                                                   for r in combined["runs"])]
    return "\n".join(lines)


def _shown(run: Path, out: Path) -> str:
    folder = run.parent if run.name == RESULTS else run
    try:
        return str(folder.resolve().relative_to(out.resolve()))
    except ValueError:
        return str(folder)


def write_combined(out: str | Path, runs: Sequence[str | Path]) -> dict[str, Any]:
    """Combine `runs` (`combine`) into `out`/results.json and `out`/results.md, each written to a
    temp name and renamed, so neither is ever half-written."""
    out = Path(out).expanduser()
    combined = combine(runs)
    combined["runs"] = [_shown(Path(r).expanduser(), out) for r in runs]  # the folder may move: relative to it
    write_json(out / RESULTS, combined, strict=True)
    write_text(out / "results.md", format_combined(combined) + "\n")
    return combined


__all__ = ["RESULTS", "combine", "format_combined", "read_run", "write_combined"]
