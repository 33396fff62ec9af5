"""`dualpath native build|status`: the compiled simulator core (``dualpath.sim.native``)."""

from __future__ import annotations

import argparse

from dualpath.sim import native


def add_native_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "native",
        help="build the compiled simulator core (mypyc), or say which core runs",
        description=(
            "The simulator's own modules compiled by mypyc (same sources, byte-identical "
            "results); DUALPATH_SIM_CORE=auto|python|native picks the core at run time."
        ),
    )
    p.add_argument("action", choices=("build", "status"))
    p.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: cores)")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    argv = [args.action, "--jobs", str(args.jobs)] + (["--verbose"] if args.verbose else [])
    return native.main(argv)
