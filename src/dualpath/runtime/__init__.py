"""The real PD-disaggregated runtime (docs/runtime.md): engine processes, a tiny real model,
a persistent KV store, shared-memory buffers, emulated NICs, both load paths.

Imports torch / numpy only inside its modules; ``dualpath`` itself imports without them.
Entry point: ``dualpath.runtime.session.Runtime``.
"""
