"""omnirelay: a runtime for serving multi-stage model pipelines.

Layers (docs/design.md §1): serving → orchestrator → engine → transfer → connectors → payload,
with pipeline (topology and contracts), processors and models plugging in through the
pipeline registry.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
