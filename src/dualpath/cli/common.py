"""Shared CLI plumbing: config arguments, one-line errors."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dualpath.config import DEFAULT_PRESET, Config, apply_overrides, load_toml, preset

if TYPE_CHECKING:  # the simulator is imported only where a command needs it
    from dualpath.sim.cache import ResultCache


def add_config_args(parser: argparse.ArgumentParser, default_preset: str = DEFAULT_PRESET) -> None:
    parser.add_argument(
        "--preset",
        default=default_preset,
        help=f"cluster preset (default: {default_preset}; `dualpath presets` lists them)",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file applied on top of the preset")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set hardware.snic_per_node=2 (repeatable; "
        "--set model=qwen32b swaps a whole model preset)",
    )


def add_ray_arg(parser: argparse.ArgumentParser) -> None:
    """``--ray-address`` of a study command (default: the local process pool; ``sim.fanout.study_pool``)."""
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="run the simulations as Ray tasks: 'local' (a new Ray instance here, --workers"
        " CPUs) or a cluster's GCS HOST:PORT (default: a local process pool)",
    )


def build_config(args: argparse.Namespace) -> Config:
    """Preset → TOML file → --set overrides, in that order. ValueError on any mistake."""
    config = preset(args.preset)
    if getattr(args, "config", None):
        config = load_toml(args.config, base=config)
    return apply_overrides(config, args.overrides)


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir`` / ``--no-cache``: the shared per-configuration result cache."""
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="result cache folder shared by sim, sweep, ablation, capacity, tune and figures "
        "(default: $DUALPATH_CACHE or runs/cache; 'off' disables)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="simulate everything; read and write no cache"
    )


def cache_from_args(args: argparse.Namespace) -> ResultCache:
    """The cache the flags choose (``--no-cache`` wins)."""
    from dualpath.sim.cache import ResultCache

    if getattr(args, "no_cache", False):
        return ResultCache(None)
    return ResultCache.resolve(getattr(args, "cache_dir", None))
