"""The per-configuration result cache that every study shares (sim, sweep, ablation, capacity,
tune, figures and the Python API): one file per simulation, keyed by what determines it.

A key is the SHA-256 of the resolved ``Config`` (``SimConfig`` included), the system, the kind
of run and its settings, the content of every file the workload reads (a trace, trajectories,
distributions) and the code version (``code_version``: the package version and a digest of
every source file a simulation runs). A simulation is a pure function of that, so a hit is
the same result bit for bit. The cache holds Python objects (gzip'd pickles) of this
process's own making: it is a local scratch folder, never an exchange format (the JSON and
CSV outputs are). Writes are atomic (temp file, then rename), so parallel writers are safe.

``ResultCache.resolve(folder)``: ``folder`` if given, else ``$DUALPATH_CACHE``, else
``runs/cache``; ``off`` (or an empty string) disables caching.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import pickle
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dualpath.config import Config, to_dict

CACHE_FORMAT = 1
DEFAULT_FOLDER = Path("runs") / "cache"
ENV_VAR = "DUALPATH_CACHE"
OFF = ("off", "none", "")
# the layers a simulation runs: a change to any of their sources is a new code version
_SIM_LAYERS = ("config", "models", "workload", "metrics", "policy", "ledger", "sim")
_PACKAGE = Path(__file__).resolve().parents[1]
# modules of those layers that only draw or store results: editing them changes no result
_NOT_RUN = ("metrics/plots.py", "sim/plots.py", "sim/cache.py", "sim/jobs.py")
# config fields that name a file the workload reads: the key holds the file's content
_FILE_FIELDS = ("trace", "trajectories", "distributions")


@functools.cache
def package_version() -> str:
    """The installed distribution's version (``dualpath.__version__``, read without importing
    the package root, which imports this module through the API)."""
    try:
        return importlib.metadata.version("dualpath")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def source_digest() -> str:
    """SHA-256 (first 16 hex digits) over the sources of the layers a simulation runs."""
    h = hashlib.sha256()
    files = [_PACKAGE / "types.py", _PACKAGE / "units.py", _PACKAGE / "__init__.py"]
    for layer in _SIM_LAYERS:
        files += sorted((_PACKAGE / layer).rglob("*.py"))
    files = [f for f in files if str(f.relative_to(_PACKAGE)) not in _NOT_RUN]
    for path in files:
        h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(_PACKAGE), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def code_version() -> dict[str, str]:
    """What every JSON output records about the code: package version, source digest (what
    the cache keys on) and the git commit when the package runs from a checkout ("" if not;
    the digest, not the commit, tells whether the simulator changed)."""
    return {
        "package": package_version(),
        "source_sha256": source_digest(),
        "git_commit": _git_commit(),
    }


def run_meta(config: Config) -> dict[str, Any]:
    """The block every JSON output carries: resolved config, seed and code version."""
    return {
        "config": to_dict(config),
        "seed": config.workload.seed,
        "code_version": code_version(),
    }


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"  # the run itself reports the file (one line)


def cache_key(
    config: Config, system: str, kind: str, extra: Mapping[str, Any] | None = None
) -> str:
    """The key of one run (see the module docstring). ``extra``: JSON-able settings of the
    run beyond the config (online settings, an in-memory workload's digest)."""
    w = config.workload
    files = {f: _file_digest(getattr(w, f)) for f in _FILE_FIELDS if getattr(w, f, "")}
    blob = json.dumps(
        {
            "format": CACHE_FORMAT,
            "code": source_digest(),
            "version": package_version(),
            "config": to_dict(config),
            "system": system,
            "kind": kind,
            "files": files,
            "extra": dict(extra or {}),
        },
        sort_keys=True,
        default=_jsonable,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple | list):
        return list(value)
    raise TypeError(f"cache key: {type(value).__name__} is not JSON-able")


class ResultCache:
    """A folder of cached results (``folder`` None: caching off, every lookup a miss).
    Counts hits and misses (a miss is then simulated)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = None if folder is None else Path(folder)
        self.hits = 0
        self.misses = 0

    @classmethod
    def resolve(cls, folder: str | Path | None = None) -> ResultCache:
        """``folder`` → ``$DUALPATH_CACHE`` → ``runs/cache``; "off" disables."""
        chosen = str(folder) if folder is not None else os.environ.get(ENV_VAR, str(DEFAULT_FOLDER))
        return cls(None if chosen.strip().lower() in OFF else Path(chosen))

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def _path(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{key}.pkl.gz"

    def get(self, key: str) -> Any | None:
        """The cached value, or None (a miss; an unreadable entry counts as a miss)."""
        if self.folder is None:
            self.misses += 1
            return None
        path = self._path(key)
        try:
            with gzip.open(path, "rb") as fh:
                value = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            self.misses += 1
            return None
        self.hits += 1
        return value

    def put(self, key: str, value: Any) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
                pickle.dump(value, fh, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def describe(self) -> str:
        """'cache runs/cache: 3 hits, 1 miss' (or 'cache off')."""
        if self.folder is None:
            return "cache off"
        return f"cache {self.folder}: {self.hits} from cache, {self.misses} simulated"
