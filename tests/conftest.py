"""The suite runs the pure-Python simulator core, the reference the compiled one is checked
against (``tests/sim/test_native.py`` runs both; ``dualpath.sim.native``). Set here, before
any test imports ``dualpath.sim``; subprocesses the tests start inherit it."""

import os

os.environ.setdefault("DUALPATH_SIM_CORE", "python")
