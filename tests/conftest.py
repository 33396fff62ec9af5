"""The shared result cache (``dualpath.sim.cache``) is off unless a test names its own folder:
a test never reads what another test (or a user's ``runs/cache``) simulated, so a test that
simulates twice to compare still simulates twice."""

import os

os.environ["DUALPATH_CACHE"] = "off"
