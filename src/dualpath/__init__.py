"""DualPath: dual-path KV-cache loading for agentic LLM inference (arXiv 2602.21548).

Layers (imports point down only): types/units → config → models/workload/metrics →
policy → sim | runtime → cli.
"""

__version__ = "0.1.0"
