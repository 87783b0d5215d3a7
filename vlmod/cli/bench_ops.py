"""`vlmod bench ops`: what a routed layer costs the host, counted (vlmod.bench.ops)."""

from __future__ import annotations

import argparse

from vlmod.cli.common import SubParsers, capacity, check_json_output, layers, write_json_result


def add_bench_ops_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    """`vlmod bench ops`: aten ops, host reads and graph breaks, dense vs MoD, per family."""
    from vlmod.plugins import vlm_variants

    families = vlm_variants()
    p = subparsers.add_parser(
        "ops",
        help="ops, host syncs and graph breaks a routed layer adds (counted, not timed)",
        description="Count what a prefill and a decode step of a tiny model of each family dispatch, dense and "
        "converted to MoD (batch 1, one image or a 4-frame clip, float32, vlmod's preallocated cache): the aten ops "
        "that launch a kernel (each one launch on a GPU, where at batch 1 the launches set the pace), the host reads "
        "(a device sync each) and, with --graph-breaks, the graph breaks of a prefill under torch._dynamo.explain. "
        "Counts do not depend on the machine.",
    )
    p.add_argument("--families", default=",".join(families),
                   help=f"comma list of families (default: all: {','.join(families)})")
    p.add_argument("--capacity", type=capacity, default=0.5, help="capacity of the MoD layers (default: 0.5)")
    p.add_argument("--layers", type=layers, default="every_other",
                   help="every_other | all | comma list of MoD layers (default: every_other)")
    p.add_argument("--router", choices=("learned", "attention", "fastv"), default="learned",
                   help="how the MoD layers select: the learned router, the attention router (its scoring, the "
                   "queries' and keys' projections, runs in each routed layer of a prefill) or FastV's rule (that "
                   "scoring in the first routed layer only) (default: learned)")
    p.add_argument("--graph-breaks", action="store_true",
                   help="also count a prefill's graph breaks (dynamo traces each model: about a minute a family) "
                   "(default: off)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    p.set_defaults(run=run_bench_ops)
    return p


def run_bench_ops(args: argparse.Namespace) -> int:
    from vlmod.bench.ops import format_host_cost, host_cost
    from vlmod.errors import InputError
    from vlmod.plugins import vlm_variants

    check_json_output(args.json)
    wanted = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(wanted) - set(vlm_variants()))
    if unknown or not wanted:
        raise InputError(f"--families: unknown {', '.join(unknown) or 'none given'}; choose from {', '.join(vlm_variants())}")
    rows = [host_cost(f, args.capacity, args.layers, breaks=args.graph_breaks, router=args.router) for f in wanted]
    print(format_host_cost(rows))
    write_json_result(args.json, {"benchmark": "ops", "capacity": args.capacity, "layers": args.layers, "router": args.router,
                                  "families": [r.to_dict() for r in rows]})
    return 0


__all__ = ["add_bench_ops_parser", "run_bench_ops"]
