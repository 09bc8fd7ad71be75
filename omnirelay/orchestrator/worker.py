"""Former home of the stage worker process, now :mod:`omnirelay.worker`.

Only :func:`~omnirelay.worker.leak_paths` is still importable from here, for the
benchmark audits that name this module; new code imports :mod:`omnirelay.worker`.
"""

from omnirelay.worker.loop import leak_paths

__all__ = ["leak_paths"]
