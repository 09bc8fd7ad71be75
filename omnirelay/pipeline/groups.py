"""Which stages share one worker process: the device groups (docs/design.md §12).

A *device group* is one worker process that hosts several stage engines, driven by one
loop (:mod:`omnirelay.worker.group`). By ``device_groups:`` of the pipeline file:

* ``auto`` (the default; docs/performance.md "Device groups"): the stages placed on the
  same CUDA device (``devices`` or ``executor_args.device``: ``cuda:0``; ``cuda`` is
  ``cuda:0``) share one process — one
  CUDA context, one caching allocator, no time slices between processes; every other
  stage (the CPU, where the cores are the parallelism) keeps a process of its own;
* ``on``: also the stages on no CUDA device share one process (a CPU pipeline as a group:
  tests, or a machine with one core);
* ``off``: one process per stage (to compare, or under ``--mps``).

Whatever the setting, a stage stays alone when it says ``own_process: true``, runs
replicas (a request is bound to one replica; each has its own process), sets process
environment that the others do not (``env``, ``gpu_share``, ``gpu_priority``: read by the
CUDA driver once per process), or the pipeline is placed on Ray nodes.

An edge between two stages of one group resolves to the ``inproc`` backend
(:func:`omnirelay.pipeline.placement.edge_backend`): its objects are handed over by
reference inside the process (docs/protocol.md §3.10).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnirelay.pipeline.config import PipelineConfig, StageConfig

__all__ = ["cuda_device", "group_key", "process_groups", "shares_process", "sizing_device"]

_CUDA = re.compile(r"cuda(?::(\d+))?")


def group_key(cfg: PipelineConfig, stage: StageConfig) -> tuple[object, ...] | None:
    """What a stage's group is known by (its device and process environment); None when
    the stage runs in a process of its own."""
    from omnirelay.pipeline.config import DeviceGroups

    if cfg.device_groups is DeviceGroups.OFF or cfg.placement.is_ray:
        return None
    if stage.own_process or stage.replicas > 1:
        return None
    where = cuda_device(stage)
    if where is None and cfg.device_groups is DeviceGroups.ON:
        where = "host"
    if where is None:
        return None
    return (where, tuple(sorted(stage.process_env().items())))


def process_groups(cfg: PipelineConfig) -> tuple[tuple[int, ...], ...]:
    """The pipeline's worker indices (:meth:`PipelineConfig.workers`) by the process that
    hosts them, in the order of each group's first worker: ``((0,), (1, 2))`` is a stage
    alone and two stages sharing a process."""
    groups: dict[object, list[int]] = {}
    for worker in cfg.workers():
        key = group_key(cfg, cfg.stages[worker.stage_id])
        groups.setdefault(("alone", worker.index) if key is None else key, []).append(worker.index)
    return tuple(tuple(g) for g in groups.values())


def shares_process(cfg: PipelineConfig, src: int, dst: int) -> bool:
    """Do stages ``src`` and ``dst`` run in one worker process?"""
    a = group_key(cfg, cfg.stages[src])
    return a is not None and a == group_key(cfg, cfg.stages[dst])


def cuda_device(stage: StageConfig) -> str | None:
    """The one CUDA device a stage runs on (``devices`` or ``executor_args.device``:
    ``cuda:0``; ``cuda`` is ``cuda:0``), or None."""
    device = stage.executor_args.get("device") or stage.devices
    match = _CUDA.fullmatch(str(device).strip()) if device else None
    return None if match is None else f"cuda:{int(match.group(1) or 0)}"


def sizing_device(cfg: PipelineConfig, stage_ids: tuple[int, ...]) -> str | None:
    """The CUDA device on which the process hosting ``stage_ids`` sizes its KV slots from
    the memory left (:mod:`omnirelay.models.runner.memory`): theirs, when they all run on
    it, none runs replicas, and no stage of another process shares it (two processes
    would each count the other's memory as theirs). None: slots are fixed numbers."""
    mine = {cuda_device(cfg.stages[i]) for i in stage_ids}
    if len(mine) != 1 or None in mine or any(cfg.stages[i].replicas > 1 for i in stage_ids):
        return None
    device = mine.pop()
    others = (s for s in cfg.stages if s.id not in stage_ids)
    return None if any(cuda_device(s) == device for s in others) else device
