"""Where a study's simulations run: a local process pool, or Ray tasks across a cluster.

``study_pool(workers, ray_address)`` yields an executor with ``submit(fn, *args)`` returning
``concurrent.futures.Future`` objects, so a study's loop (``as_completed``, its progress bar,
its result cache) is the same either way. ``ray_address`` None: a ``ProcessPoolExecutor`` of
``workers`` processes. ``"local"``: a new Ray instance on this host (loopback, a private
temp dir, removed afterwards). ``HOST:PORT``: the cluster whose GCS listens there (every
node needs this package installed, at the same version). A process that is already a Ray
driver (``ray.is_initialized()``) uses its session as it is. Each simulation is one Ray task
of one CPU; Ray places them over the cluster's nodes. Results are the same bits either way:
a simulation is a pure function of its arguments.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Protocol

from dualpath.deploy.ray_address import check_gcs_address

LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # results only: a few MB per simulation
LOCAL_TEMP_PREFIX = "dpstudy-"  # short, under /tmp: Ray's Unix socket paths live in it


class StudyPool(Protocol):
    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]: ...


def check_ray_address(address: str) -> None:
    """ValueError (one line) unless ``address`` is ``local`` or a ``HOST:PORT`` that accepts
    a TCP connection (a Ray GCS)."""
    check_gcs_address(address, local_ok=True)


class RayPool:
    """``submit`` as a Ray task (one CPU each); the futures are Ray's own."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._remote: dict[Callable[..., Any], Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1, max_retries=0)(fn)
        future: Future[Any] = remote.remote(*args).future()
        return future


@contextlib.contextmanager
def study_pool(workers: int, ray_address: str | None = None) -> Iterator[StudyPool]:
    """The executor of a study (see the module docstring); shuts down what it started."""
    if ray_address is None:
        if workers < 1:
            raise ValueError(f"--workers={workers} is invalid: must be >= 1")
        with ProcessPoolExecutor(max_workers=workers) as pool:
            yield pool
        return
    check_ray_address(ray_address)
    try:
        ray: Any = importlib.import_module("ray")
    except ImportError:
        raise ValueError(
            "--ray-address needs Ray, which is not installed: pip install 'dualpath[ray]'"
        ) from None
    if ray.is_initialized():
        yield RayPool(ray)
        return
    with contextlib.ExitStack() as started:
        if ray_address == "local":
            temp_dir = tempfile.mkdtemp(prefix=LOCAL_TEMP_PREFIX, dir="/tmp")
            started.callback(shutil.rmtree, temp_dir, ignore_errors=True)
            ray.init(
                address="local",  # a new instance, whatever RAY_ADDRESS or /tmp/ray name
                num_cpus=workers if workers >= 1 else (os.cpu_count() or 1),
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=temp_dir,
                logging_level="WARNING",
            )
        else:
            ray.init(address=ray_address, logging_level="WARNING")
        started.callback(ray.shutdown)  # before the temp dir goes
        yield RayPool(ray)
