"""The stage worker process: :func:`worker_main`, one stage engine behind the control plane.

:func:`worker_main` is the process target (forked from the front's fork server or
spawned, never forked from the front: :mod:`omnirelay.worker.processes`). It

1. takes the front's environment (:attr:`WorkerSpec.environ`), sets the stage's process
   environment (``env``, ``gpu_share``, ``gpu_priority`` of
   its :class:`~omnirelay.pipeline.StageConfig`), connects its control sockets, builds the engine through the factory named in
   :class:`~omnirelay.worker.spec.WorkerSpec` (``"module:function"``, called as
   ``factory(pipeline, stage_id)``, plus ``tracer=`` a new step tracer when the spec has
   a ``tracer_factory``), starts the control receive thread and says
   :class:`Hello` (or :class:`StartupFailed` and exits 1);
2. runs :class:`~omnirelay.worker.loop.WorkerLoop` until :class:`Shutdown`, SIGTERM, or
   the parent is gone (the receive thread watches it and posts a Shutdown);
3. shuts the engine down and closes its sockets (the engine closes its connector,
   which unlinks what it still owns under /dev/shm), says :class:`Goodbye`, and exits 0
   with ``os._exit`` (nothing is left to finalize; see the end of :func:`worker_main`).

SIGINT is ignored (Ctrl-C in a terminal reaches the whole process group; the front
shuts the workers down in order). SIGTERM ends the loop cleanly.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType

from omnirelay.engine.interfaces import StageEngineProtocol
from omnirelay.errors import ConfigError, ModelError, PipelineError
from omnirelay.models.runner.memory import DeviceBudget, activate
from omnirelay.pipeline.groups import sizing_device
from omnirelay.worker.loop import WorkerLoop
from omnirelay.worker.messages import Goodbye, Hello, StartupFailed, ToFront
from omnirelay.worker.processes import watch_parent
from omnirelay.worker.spec import WorkerSpec, load_engine_factory
from omnirelay.worker.worker_control import CommandInbox, WorkerControl

__all__ = ["group_main", "worker_main"]


class _Stop(Exception):
    """Raised out of the loop by SIGTERM."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


def _build_engine(
    spec: WorkerSpec, control: WorkerControl, is_front_alive: Callable[[], bool]
) -> StageEngineProtocol | None:
    """The engine, or None after telling the front why it could not be built."""
    try:
        factory = load_engine_factory(spec.engine_factory)
        if spec.tracer_factory is None:
            return factory(spec.pipeline, spec.stage_id)
        params = inspect.signature(factory).parameters
        if "tracer" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ConfigError(
                f"engine factory {spec.engine_factory!r} takes no tracer= argument, so its stages "
                "cannot time their steps: add one, or start the pipeline without trace_steps"
            )
        return factory(spec.pipeline, spec.stage_id, tracer=spec.tracer_factory())
    except _Stop:
        raise
    except Exception as exc:
        # A model's own error (a graph capture out of memory: what to change) is one line.
        detail = str(exc) if isinstance(exc, ModelError) else f"{exc!r}\n{traceback.format_exc()}"
        control.send(
            StartupFailed(spec.stage_id, os.getpid(), detail),
            is_peer_alive=is_front_alive,
            timeout_s=5.0,
        )
        return None


def worker_main(spec: WorkerSpec) -> None:
    """The process target of one stage worker (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if spec.environ is not None:  # forked from the fork server: the front's environment now
        os.environ.clear()
        os.environ.update(spec.environ)
    # Before anything creates a CUDA context: the driver reads MPS settings only then.
    os.environ.update(spec.pipeline.stages[spec.stage_id].process_env())
    is_parent_alive = watch_parent(spec.parent_pid)

    def send(message: ToFront) -> None:
        control.send(message, is_peer_alive=is_parent_alive)

    control = WorkerControl(spec.paths, spec.worker_index)
    engine: StageEngineProtocol | None = None
    is_clean = False
    try:
        budget = _device_budget((spec,))
        with activate(budget):
            engine = _build_engine(spec, control, is_parent_alive)
        capacities = None
        if engine is not None:
            capacities = _size_slots((spec,), [engine], [control], budget, is_parent_alive)
            if capacities is None:  # told the front why
                engine.shutdown()
                engine = None
        if engine is not None and capacities is not None:
            inbox = CommandInbox()
            loop = WorkerLoop(engine, inbox, send, spec)
            control.start_receiving(
                inbox, wake=loop.wake, is_parent_alive=is_parent_alive, parent_check_s=spec.parent_check_s
            )
            stage = spec.pipeline.stages[spec.stage_id]
            send(Hello(spec.stage_id, os.getpid(), replica=stage.replica, capacity=capacities[0]))
            loop.run()
            is_clean = True
    except _Stop:
        is_clean = engine is not None
    finally:
        # A SIGTERM during cleanup must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if engine is not None:
                engine.shutdown()
            if is_clean and is_parent_alive():
                try:
                    control.send(Goodbye(spec.stage_id), is_peer_alive=is_parent_alive, timeout_s=1.0)
                except PipelineError:
                    pass
        finally:
            control.close()
    # Everything this process owns is closed by now. Skip the interpreter's finalization
    # (a second or more with torch loaded, and it would wait for any stray non-daemon
    # thread): the front is waiting for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if is_clean else 1)


def group_main(specs: tuple[WorkerSpec, ...]) -> None:
    """The process target of a device group: several stage workers in one process, one
    loop (:mod:`omnirelay.worker.group`). Each stage connects its own control sockets,
    builds its engine and says hello once all are built; one that cannot be built says
    :class:`StartupFailed` and the process exits 1 (its stages share its fate). Ends as
    :func:`worker_main` does, once every stage was told to stop."""
    from omnirelay.worker.group import GroupLoop, GroupWaker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    first = specs[0]
    if first.environ is not None:
        os.environ.clear()
        os.environ.update(first.environ)
    os.environ.update(first.pipeline.stages[first.stage_id].process_env())  # the same for all
    is_parent_alive = watch_parent(first.parent_pid)
    controls = [WorkerControl(spec.paths, spec.worker_index) for spec in specs]
    engines: list[StageEngineProtocol] = []
    is_clean = False
    is_sized = True
    try:
        budget = _device_budget(specs)
        with activate(budget):
            for spec, control in zip(specs, controls, strict=True):
                if budget is not None:
                    stage = spec.pipeline.stages[spec.stage_id]
                    budget.stage = (stage.label, stage.max_num_seqs)
                before = _device_bytes()
                engine = _build_engine(spec, control, is_parent_alive)
                if engine is None:
                    raise _Stop()
                engines.append(engine)
                _say_built(spec, before, len(specs))
        capacities = _size_slots(specs, engines, controls, budget, is_parent_alive)
        if capacities is None:
            is_sized = False
            raise _Stop()
        waker = GroupWaker()
        loops: list[WorkerLoop] = []
        for spec, control, engine in zip(specs, controls, engines, strict=True):

            def send(message: ToFront, control: WorkerControl = control) -> None:
                control.send(message, is_peer_alive=is_parent_alive)

            loops.append(WorkerLoop(engine, CommandInbox(), send, spec))
        group = GroupLoop(loops, waker, idle_wait_s=min(s.idle_wait_s for s in specs))
        for spec, control, loop in zip(specs, controls, loops, strict=True):
            control.start_receiving(
                loop.inbox,
                wake=group.wake(loop),
                is_parent_alive=is_parent_alive,
                parent_check_s=spec.parent_check_s,
            )
        for spec, loop, capacity in zip(specs, loops, capacities, strict=True):
            stage = spec.pipeline.stages[spec.stage_id]
            loop.send(Hello(spec.stage_id, os.getpid(), replica=stage.replica, capacity=capacity))
        group.run()
        is_clean = True
    except _Stop:
        is_clean = is_sized and len(engines) == len(specs)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for engine in engines:
                engine.shutdown()
            if is_clean and is_parent_alive():
                for spec, control in zip(specs, controls, strict=True):
                    try:
                        control.send(Goodbye(spec.stage_id), is_peer_alive=is_parent_alive, timeout_s=1.0)
                    except PipelineError:
                        pass
        finally:
            for control in controls:
                control.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if is_clean else 1)


def _device_budget(specs: tuple[WorkerSpec, ...]) -> DeviceBudget | None:
    """Where the process's stages size their KV slots from the device memory left
    (:func:`omnirelay.pipeline.groups.sizing_device`); None: they keep fixed counts."""
    pipeline = specs[0].pipeline
    device = sizing_device(pipeline, tuple(spec.stage_id for spec in specs))
    if device is None:
        return None
    budget = DeviceBudget(device, pipeline.gpu_memory_utilization)
    stage = pipeline.stages[specs[0].stage_id]
    budget.stage = (stage.label, stage.max_num_seqs)
    return budget


def _size_slots(
    specs: tuple[WorkerSpec, ...],
    engines: list[StageEngineProtocol],
    controls: list[WorkerControl],
    budget: DeviceBudget | None,
    is_front_alive: Callable[[], bool],
) -> list[int] | None:
    """Build the runners that wait for the sizing (weights first, then every stage's KV,
    then their graphs) and limit each stage to its slots; returns each stage's capacity,
    or None after telling the front, for every stage, why it could not (not even one slot
    fits, or the build failed)."""
    capacities = [spec.pipeline.stages[spec.stage_id].max_num_seqs for spec in specs]
    if budget is None or not budget.is_pending:
        return capacities
    try:
        slots = budget.finish()
    except _Stop:
        raise
    except Exception as exc:
        # Not even one slot fits: its one line says all; anything else with its traceback.
        detail = str(exc) if isinstance(exc, ModelError) else f"{exc!r}\n{traceback.format_exc()}"
        for spec, control in zip(specs, controls, strict=True):
            control.send(
                StartupFailed(spec.stage_id, os.getpid(), detail), is_peer_alive=is_front_alive, timeout_s=5.0
            )
        return None
    for index, (spec, engine) in enumerate(zip(specs, engines, strict=True)):
        count = slots.get(spec.pipeline.stages[spec.stage_id].label)
        limit = getattr(engine, "limit_slots", None)
        if count is not None and callable(limit):
            capacities[index] = int(limit(count))
    return capacities


def _device_bytes() -> int | None:
    """Bytes the process's CUDA caching allocator holds on its devices (None: no CUDA yet)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))


def _say_built(spec: WorkerSpec, before: int | None, size: int) -> None:
    """One startup line per stage of a group: what its build took of the shared device
    memory (weights, KV slots, graph pools together; only the weights where its KV is
    sized from the memory left, whose own line follows once every stage is built)."""
    after = _device_bytes()
    if after is None:
        return
    took = after - (before or 0)
    stage = spec.pipeline.stages[spec.stage_id]
    print(
        f"omnirelay: {stage.label} built in process {os.getpid()} ({size} stages): "
        f"{took / 2**30:.2f} GiB of device memory (weights, and KV slots and graph pools unless sized below), "
        f"{after / 2**30:.2f} GiB for the process so far",
        file=sys.stderr,
        flush=True,
    )
