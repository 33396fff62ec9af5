"""The compiled simulator core: the simulator's own modules compiled by mypyc, selectable.

The compiled core is not a second implementation: mypyc compiles the very source files of
``MODULES`` (their type annotations become native attributes, native floats and direct
calls) into C extensions, built here by ``dualpath native build`` (``make native``; ``make
run`` and ``make test`` build it, with pip's mypy and the machine's C compiler, and go on in
pure Python where that fails). The pure-Python modules stay the reference: the tests run them, and
``tests/sim/test_native.py`` and ``benchmarks/sim_digests.py --core both`` check that the
compiled core gives byte-identical event logs and results. The C code is compiled with
``-ffp-contract=off`` (no fused multiply-add), so every float operation is the same IEEE
double operation in the same order as in the interpreter.

Which core runs is decided once per process, when ``dualpath.sim`` is first imported, by
``DUALPATH_SIM_CORE`` (``dualpath native status`` says which):

- ``python`` (default): pure Python (at paper scale the compiled core is no faster and
  needs 1.7× the memory; docs/simulator.md "Speed");
- ``auto``: compiled when it is built for this interpreter and every one of its
  sources is unchanged since the build (a SHA-256 per file in the manifest); else pure Python
  (with one line on stderr when a build exists but is stale);
- ``native``: compiled, or ``CoreChoiceError`` (an ImportError) saying why not.

The compiled modules live in ``_native/`` beside this file (ignored by git) and are served by
a meta-path finder, so a stale or absent build never shadows the sources. Only the
simulator's modules are compiled: the policy core, the ledger and the records are shared
with the runtime and stay pure Python (their validation errors, pickling and monkeypatching
in tests are unchanged).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TypeVar

_C = TypeVar("_C")
try:  # mypy (which builds the compiled core) brings it; compiled, it marks Python classes
    from mypy_extensions import mypyc_attr
except ImportError:  # pure Python only: the marker does nothing

    def mypyc_attr(*args: object, **kwargs: object) -> Callable[[_C], _C]:  # type: ignore[misc]
        return lambda cls: cls


ENV = "DUALPATH_SIM_CORE"
CHOICES = ("auto", "python", "native")
# the hot path of a simulation; not: runner/results/studies/plots (run once per simulation),
# online/observe (drivers), fanout (processes), flowreplay (benchmark support), native
MODULES = (
    "admission",
    "channel",
    "cluster",
    "decode",
    "events",
    "fabric",
    "flowtable",
    "maxmin",
    "network",
    "node_io",
    "passes",
    "pipeline",
    "prefill",
    "rates",
    "request",
    "steptime",
    "transfers",
)
PACKAGE = "dualpath.sim"
GROUP = "dualpath_simcore"  # mypyc's shared library: GROUP + "__mypyc"
SIM_DIR = Path(__file__).resolve().parent
NATIVE_DIR = SIM_DIR / "_native"
MANIFEST = NATIVE_DIR / "manifest.json"
# no fused multiply-add (bit-identical floats); the rest is mypyc's default -O3
CFLAGS = "-ffp-contract=off"

_state: dict[str, str] = {}


class CoreChoiceError(ImportError):
    """``DUALPATH_SIM_CORE`` names no core, or the compiled one where it cannot be used."""


def _source_digests() -> dict[str, str]:
    return {m: hashlib.sha256((SIM_DIR / f"{m}.py").read_bytes()).hexdigest() for m in MODULES}


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def check() -> str:
    """Why the compiled core cannot be used, or "" when it can."""
    if not MANIFEST.is_file():
        return "not built (make native)"
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable manifest {MANIFEST}: {exc}"
    if manifest.get("suffix") != _suffix():
        return f"built for {manifest.get('suffix')!r}, this interpreter loads {_suffix()!r}"
    if manifest.get("sources") != _source_digests():
        stale = sorted(
            m for m, d in _source_digests().items() if manifest.get("sources", {}).get(m) != d
        )
        return f"stale: {', '.join(stale)} changed since the build (make native)"
    missing = [n for n in (*MODULES, f"{GROUP}__mypyc") if not _so_path(n).is_file()]
    if missing:
        return f"incomplete build: {', '.join(missing)} missing (make native)"
    return ""


def _so_path(short: str) -> Path:
    return NATIVE_DIR / f"{short}{_suffix()}"


class _NativeFinder(importlib.abc.MetaPathFinder):
    """Serves ``dualpath.sim.<m>`` for m in MODULES (and mypyc's shared library) from
    ``_native/``; every other import falls through to the normal finders."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, short = fullname.rpartition(".")
        if (prefix == PACKAGE and short in MODULES) or fullname == f"{GROUP}__mypyc":
            loader = importlib.machinery.ExtensionFileLoader(fullname, str(_so_path(short)))
            return importlib.util.spec_from_file_location(fullname, _so_path(short), loader=loader)
        return None


def install() -> str:
    """Choose the core for this process (once) and return it: "native" or "python"."""
    if "core" in _state:
        return _state["core"]
    choice = os.environ.get(ENV, "python").strip().lower() or "python"
    if choice not in CHOICES:
        raise CoreChoiceError(f"{ENV}={choice!r}: must be one of {', '.join(CHOICES)}")
    why = "" if choice == "python" else check()
    if choice == "native" and why:
        raise CoreChoiceError(f"{ENV}=native but the compiled simulator core is {why}")
    core = "native" if choice != "python" and not why else "python"
    if core == "native":
        sys.meta_path.insert(0, _NativeFinder())
    elif choice == "auto" and MANIFEST.is_file():
        print(f"dualpath: compiled simulator core {why}; running pure Python", file=sys.stderr)
    _state["core"] = core
    return core


def core() -> str:
    """The core this process runs: "native" or "python"."""
    return _state.get("core", "python")


_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
paths, lib, tmp, jobs = sys.argv[1].split("\\n"), sys.argv[2], sys.argv[3], sys.argv[4]
exts = mypycify(
    ["--ignore-missing-imports", *paths], opt_level="3", group_name="%s", target_dir=tmp
)
for ext in exts:
    ext.extra_compile_args = [*ext.extra_compile_args, "%s"]
setup(
    name="dualpath-simcore",
    ext_modules=exts,
    script_args=["build_ext", "--build-lib", lib, "--build-temp", tmp, "--parallel", jobs],
)
"""


def build(jobs: int = 0, quiet: bool = True) -> float:
    """Compile MODULES into ``_native/`` (replacing a previous build only once this one
    succeeded); returns the seconds it took. RuntimeError naming what failed."""
    try:
        import mypyc  # noqa: F401
        import setuptools  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"cannot build the compiled core: {exc} (pip install mypy)") from None
    t0 = time.perf_counter()
    jobs = jobs or max(1, os.cpu_count() or 1)
    digests = _source_digests()
    with tempfile.TemporaryDirectory(prefix="dualpath-native-") as tmp:
        lib = Path(tmp) / "lib"
        paths = "\n".join(str(SIM_DIR / f"{m}.py") for m in MODULES)
        c_dir = str(Path(tmp) / "c")
        proc = subprocess.run(
            [sys.executable, "-c", _SETUP % (GROUP, CFLAGS), paths, str(lib), c_dir, str(jobs)],
            cwd=tmp,
            capture_output=quiet,
            text=True,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise RuntimeError("mypyc build failed:\n" + "\n".join(tail))
        built = {m: lib / "dualpath" / "sim" / f"{m}{_suffix()}" for m in MODULES} | {
            f"{GROUP}__mypyc": lib / f"{GROUP}__mypyc{_suffix()}"
        }
        missing = [str(p) for p in built.values() if not p.is_file()]
        if missing:
            raise RuntimeError(f"mypyc build produced no {', '.join(missing)}")
        if digests != _source_digests():
            raise RuntimeError("sources changed during the build; run it again")
        NATIVE_DIR.mkdir(exist_ok=True)
        MANIFEST.unlink(missing_ok=True)  # a half-copied build is never 'current'
        for short, src in built.items():
            dst = _so_path(short)
            tmp_dst = dst.with_name(dst.name + ".tmp")
            tmp_dst.write_bytes(src.read_bytes())
            tmp_dst.replace(dst)  # a running process keeps its mapped old file
    seconds = time.perf_counter() - t0
    manifest = {
        "suffix": _suffix(),
        "python": sys.version.split()[0],
        "mypyc": _mypy_version(),
        "cflags": CFLAGS,
        "sources": digests,
        "build_s": round(seconds, 1),
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    return seconds


def _mypy_version() -> str:
    from mypy.version import __version__

    return str(__version__)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="dualpath native", description=__doc__)
    ap.add_argument("action", choices=("build", "status"), help="compile, or say which core")
    ap.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: cores)")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = ap.parse_args(argv)
    if args.action == "status":
        why = check()
        print(f"compiled simulator core: {why or 'built and current'}; this process runs: {core()}")
        return 0
    try:
        seconds = build(args.jobs, quiet=not args.verbose)
    except RuntimeError as exc:
        print(f"dualpath: {exc}", file=sys.stderr)
        return 1
    print(
        f"compiled simulator core: {len(MODULES)} modules built in {seconds:.0f} s ({NATIVE_DIR})"
    )
    return 0
