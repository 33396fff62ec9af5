"""The entry point of an engine process (PE or DE by id). Only engine processes use torch:
this module imports neither engine until it runs, so the launcher and the scheduler that
import it never load torch."""

from __future__ import annotations

from typing import Any

from dualpath.runtime.env import ProcEnv, child_setup
from dualpath.runtime.messages import ErrorMsg


def engine_main(env: ProcEnv, engine_id: int, inbox: Any, crash_at: int) -> None:
    """Process entry point of engine ``engine_id`` (PE or DE by id). Only engine processes
    use torch: the launcher and scheduler never import it (under the fork server the storage
    workers have it loaded, shared copy-on-write, unused)."""
    name = env.topology.engine_name(engine_id)
    child_setup(env.parent_pid, name)
    env.start_heartbeat(name)
    try:
        if env.topology.is_pe(engine_id):
            from dualpath.runtime.pe_engine import PrefillEngine

            engine: Any = PrefillEngine(env, engine_id, crash_at)
        else:
            from dualpath.runtime.de_engine import DecodeEngine

            engine = DecodeEngine(env, engine_id, crash_at)
        engine.serve(inbox)
    except Exception as err:
        env.results.put(ErrorMsg(name, f"{type(err).__name__}: {err}"))
        raise
