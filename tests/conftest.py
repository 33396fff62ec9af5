"""The suite runs the pure-Python simulator core, the reference the compiled one is checked
against (``tests/sim/test_native.py`` runs both; ``dualpath.sim.native``). Set here, before
any test imports ``dualpath.sim``; subprocesses the tests start inherit it.

The shared result cache (``dualpath.sim.cache``) is off unless a test names its own folder:
a test never reads what another test (or a user's ``runs/cache``) simulated, so a test that
simulates twice to compare still simulates twice."""

import os

os.environ.setdefault("DUALPATH_SIM_CORE", "python")
os.environ["DUALPATH_CACHE"] = "off"
