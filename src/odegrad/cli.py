"""Command line: ``python -m odegrad demo`` and ``python -m odegrad bench``.

``demo`` recovers the heat-capacity field of seed 001's 3-d heat diffusion from noisy final
temperatures by gradient descent through ``og.solve`` (``--problem lv``: fits the four
Lotka-Volterra parameters to noisy counts instead); ``bench`` runs the benchmark scripts of a
source checkout.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._bench import load_bench_json, run_bench, summarize_bench
from ._demo import DEMOS, run_demo

__all__ = ["build_parser", "load_bench_json", "main", "summarize_bench"]


def build_parser() -> argparse.ArgumentParser:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(
        prog="odegrad" if argv0 == "odegrad" else "python -m odegrad",
        description="odegrad: solve ODEs in JAX and differentiate their solutions.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench}")
    demo = sub.add_parser(
        "demo",
        help="recover seed 001's heat-capacity field (or, --problem lv, Lotka-Volterra "
        "parameters) from noisy data by gradient descent through og.solve",
    )
    demo.add_argument(
        "--problem",
        choices=sorted(DEMOS),
        default="heat",
        help="heat: Ci of the 3-d heat diffusion (default); lv: Lotka-Volterra parameters",
    )
    demo.add_argument(
        "--out", default="odegrad-demo", help="folder for the PNG plots (default ./odegrad-demo)"
    )
    demo.add_argument(
        "--iters", type=int, default=None, help="optimiser iterations (default heat 150, lv 300)"
    )
    demo.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate of Adam (default 0.05)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the observation noise")
    demo.add_argument("--n", type=int, default=16, help=argparse.SUPPRESS)  # heat grid n^3
    demo.add_argument("--no-optax", action="store_true", help=argparse.SUPPRESS)
    bench = sub.add_parser(
        "bench",
        help="run the benchmark suite of a source checkout; one summary table and a chart",
    )
    bench.add_argument("--quick", action="store_true", help="pass --quick to every script")
    bench.add_argument(
        "--out",
        default="odegrad-bench",
        help="folder for the JSON results and bench.png (default ./odegrad-bench)",
    )
    bench.add_argument("--dir", default=None, help="the benchmarks folder (default: found)")
    bench.add_argument(
        "names",
        nargs="*",
        help="only these scripts (e.g. lotka_volterra; default: wave_scan_parity, "
        "lotka_volterra, diffusion3d, stiff, neural_ode)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.iters is not None and args.iters < 0:
            parser.error("--iters must be >= 0")
        if args.n < 4:
            parser.error("--n must be >= 4")
        return run_demo(
            args.out,
            args.iters,
            args.lr,
            args.seed,
            use_optax=not args.no_optax,
            problem=args.problem,
            n=args.n,
        )
    if args.command == "bench":
        return run_bench(args.quick, args.names, args.dir, args.out)
    parser.print_help()
    return 0
