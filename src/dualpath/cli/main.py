"""`dualpath` entry point: subcommands, one-line errors (exit 2) for user mistakes."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from dualpath import __version__
from dualpath.cli.common import add_config_args, build_config
from dualpath.cli.plan_cmd import add_plan_parser
from dualpath.config import CLUSTER_PRESETS, dump_json

# Subcommands provided by optional layers: (module, function that adds the parser).
_OPTIONAL = (
    ("dualpath.cli.sim_cmd", "add_sim_parser"),
    ("dualpath.cli.sim_cmd", "add_sweep_parser"),
    ("dualpath.cli.peers_cmd", "add_peers_parser"),
    ("dualpath.cli.runtime_cmd", "add_bench_parser"),
    ("dualpath.cli.figures_cmd", "add_figures_parser"),
    ("dualpath.cli.online_cmd", "add_online_parser"),
    ("dualpath.cli.online_cmd", "add_capacity_parser"),
    ("dualpath.cli.online_cmd", "add_ablation_parser"),
    ("dualpath.cli.online_cmd", "add_replay_parser"),
    ("dualpath.cli.online_cmd", "add_trace_parser"),
    ("dualpath.cli.serve_cmd", "add_serve_parser"),
    ("dualpath.cli.serve_cmd", "add_loadgen_parser"),
    ("dualpath.cli.vllm_cmd", "add_sidecar_parser"),
    ("dualpath.cli.vllm_cmd", "add_router_parser"),
    ("dualpath.cli.qos_cmd", "add_qos_parser"),
    ("dualpath.cli.tune_cmd", "add_tune_parser"),
    ("dualpath.cli.validate_cmd", "add_validate_parser"),
    ("dualpath.cli.cluster_cmd", "add_cluster_parser"),
)


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit code 2."""


def _add_config_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the resolved config as JSON")
    add_config_args(p)
    p.set_defaults(func=lambda a: print(dump_json(build_config(a))) or 0)


def _add_presets_parser(sub: argparse._SubParsersAction) -> None:
    def run(_: argparse.Namespace) -> int:
        for name in sorted(CLUSTER_PRESETS):
            c = CLUSTER_PRESETS[name]
            print(
                f"{name:<14} model={c.model.name:<8} hardware={c.hardware.name:<13} {c.cluster.label}"
            )
        return 0

    p = sub.add_parser("presets", help="list cluster presets")
    p.set_defaults(func=run)


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="the main job on built-in defaults (what `make run` does)")
    p.add_argument("--out", default="runs/default", help="output folder (default: runs/default)")
    p.set_defaults(func=_run_main_job)


def _run_main_job(args: argparse.Namespace) -> int:
    from dualpath.cli.sim_cmd import run_default

    return int(run_default(args.out))


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``dualpath CMD: error: ...``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _is_ours(module: str | None) -> bool:
    return module is None or module == "dualpath" or module.startswith("dualpath.")


def _add_missing_parser(sub: argparse._SubParsersAction, adder: str, missing: str) -> None:
    """A subcommand whose third-party dependency is not installed: one line when used."""
    name = adder.removeprefix("add_").removesuffix("_parser")

    def run(_: argparse.Namespace) -> int:
        raise UserError(
            f"`dualpath {name}` needs the Python package {missing!r}, which is not installed: "
            "run `make run` (or pip install -e '.[plot,runtime]')"
        )

    p = sub.add_parser(
        name, help=f"(unavailable: needs {missing})", add_help=False, prefix_chars="\0"
    )
    p.add_argument("rest", nargs="*")  # every argument accepted: the one line comes on use
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dualpath",
        description="DualPath: dual-path KV-cache loading for agentic LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"dualpath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run_parser(sub)
    add_plan_parser(sub)
    for module_name, adder in _OPTIONAL:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if _is_ours(err.name):
                raise  # a layer of this package missing or broken: a bug, never "invalid choice"
            _add_missing_parser(sub, adder, err.name or "?")
            continue
        getattr(module, adder)(sub)
    _add_config_parser(sub)
    _add_presets_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, OverflowError, UserError) as exc:
        print(f"dualpath: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        # a path the user named (output folder, config, store root) cannot be used
        print(f"dualpath: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dualpath: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
