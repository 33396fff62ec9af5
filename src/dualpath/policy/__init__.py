"""The DualPath policy core (SPEC §7): deterministic, no I/O, no clock (`now` is an argument).

Shared by the simulator and the runtime; decisions come back as frozen command objects.
"""
