"""omnirelay.worker: the stage worker process — one stage engine behind the control plane.

Layering: the orchestrator (front process) starts workers and talks to them; a worker
drives one engine. This package imports ``omnirelay.engine`` and below, never
``omnirelay.orchestrator``; what both sides of the control plane share lives here.

Files, one role each:

* ``messages.py`` — every control-plane message, typed ``msgspec`` structs (both sides).
* ``worker_control.py`` — the worker's ZeroMQ sockets and :class:`ControlPaths`, the addresses
  the front binds (its side is :mod:`omnirelay.orchestrator.front_control`).
* ``spec.py`` — :class:`WorkerSpec`, what a worker is started with; engine factories
  named ``"module:function"``.
* ``loop.py`` — :class:`WorkerLoop`: control messages in, engine steps, outputs and
  completed releases out; :func:`leak_paths` for audits.
* ``main.py`` — :func:`worker_main`, the process target; :func:`group_main`, that of a
  device group (several stage workers in one process).
* ``group.py`` — :class:`~omnirelay.worker.group.GroupLoop`: one loop drives a device
  group's stages, launching and polling their steps.
* ``factory.py`` — :func:`build_stage_engine`, the default engine factory.
"""

from omnirelay.worker.loop import WorkerLoop, leak_paths
from omnirelay.worker.main import group_main, worker_main
from omnirelay.worker.spec import DEFAULT_ENGINE_FACTORY, EngineFactory, WorkerSpec, load_engine_factory

__all__ = [
    "DEFAULT_ENGINE_FACTORY",
    "EngineFactory",
    "WorkerLoop",
    "WorkerSpec",
    "group_main",
    "leak_paths",
    "load_engine_factory",
    "worker_main",
]
