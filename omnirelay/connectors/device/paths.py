"""Which path an edge's tensors take: through host memory, or device to device.

Stages of one pipeline always run on one host (the shm connector is a same-host
transport), so an edge whose two stages both name a CUDA device can hand its tensors
over GPU-direct: a CUDA IPC handle of the producer's device pool, the consumer copying
device to device — on the same GPU, or peer to peer between two GPUs of the host.
Anything else (a stage on the CPU, the in-process backend, an edge whose finished output
the front forwards) keeps the host path.
"""

from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnirelay.pipeline.config import Edge, PipelineConfig, StageConfig

__all__ = ["MIN_BYTES", "EdgePath", "cuda_index", "edge_path", "gpu_direct_options", "stage_device"]

#: Below this size a tensor takes the host path: GPU-direct pays fixed costs per tensor
#: (its stamp checks and synchronizations), so a hidden step or a codec chunk crosses
#: faster through the host and a prefill faster device to device (docs/performance.md,
#: `omnirelay bench transfer --gpu cuda:0`).
MIN_BYTES = 256 << 10
_SMALL = f"tensors under {MIN_BYTES >> 10} KiB through the host"

_CUDA = re.compile(r"cuda(?::(\d+))?")


class EdgePath(enum.StrEnum):
    HOST = "host"  # device → host, shm slot, host → device
    GPU_SAME = "gpu-direct"  # both stages on one GPU: a device-to-device copy
    GPU_PEER = "gpu-direct-peer"  # two GPUs of the host: a peer copy
    IN_PROCESS = "in-process"  # the inproc backend: objects never leave the process


def stage_device(stage: StageConfig) -> str | None:
    """The torch device a stage's model runs on: ``executor_args.device``, else the
    stage's ``devices`` (what the worker hands its executor), else None."""
    device = stage.executor_args.get("device") or stage.devices
    return str(device) if device else None


def cuda_index(device: str | None) -> int | None:
    """``cuda:N`` → N, ``cuda`` → 0, anything else (cpu, None) → None."""
    if device is None:
        return None
    match = _CUDA.fullmatch(device.strip())
    if match is None:
        return None
    return int(match.group(1) or 0)


def edge_path(cfg: PipelineConfig, edge: Edge) -> tuple[EdgePath, str]:
    """The path of ``edge``'s tensors and why (one line for ``omnirelay check``)."""
    if edge.backend == "inproc":
        return EdgePath.IN_PROCESS, "inproc connector: one process"
    if edge.contract.value != "chunks":
        return EdgePath.HOST, "the front forwards the finished output"
    src, dst = cfg.stages[edge.src], cfg.stages[edge.dst]
    # Every replica of both stages must be on a CUDA device (each end decides alike).
    for stage in (src, dst):
        for replica in range(stage.replicas):
            device = stage_device(stage.for_replica(replica))
            if cuda_index(device) is None:
                return EdgePath.HOST, f"{stage.replica_label(replica)} is on {device or 'the default device'}"
    devices = [stage_device(src), stage_device(dst)]
    indices = [cuda_index(d) for d in devices]
    if src.replicas > 1 or dst.replicas > 1:
        used = {
            cuda_index(stage_device(st.for_replica(r))) or 0 for st in (src, dst) for r in range(st.replicas)
        }
        if len(used) > 1:
            return EdgePath.GPU_PEER, f"replicas on cuda:{sorted(used)}: CUDA IPC handle, peer copy; {_SMALL}"
    if indices[0] == indices[1]:
        return (
            EdgePath.GPU_SAME,
            f"cuda:{indices[0]} -> cuda:{indices[1]}: CUDA IPC handle, device copy; {_SMALL}",
        )
    return EdgePath.GPU_PEER, f"cuda:{indices[0]} -> cuda:{indices[1]}: CUDA IPC handle, peer copy; {_SMALL}"


def gpu_direct_options(cfg: PipelineConfig, stage: StageConfig) -> dict[str, object]:
    """The shm connector options of ``stage``'s GPU-direct edges (docs/protocol.md §3.9):
    ``gpu_direct_to`` the stages it sends to device to device, ``gpu_direct_in`` whether
    it receives so, ``device`` its own device. Empty when it has no such edge, so a host
    stage's connector is built exactly as before."""
    to: list[int] = []
    into = False
    for edge in cfg.edges():
        if stage.id not in (edge.src, edge.dst) or edge.backend != "shm":
            continue
        if edge_path(cfg, edge)[0] not in (EdgePath.GPU_SAME, EdgePath.GPU_PEER):
            continue
        if edge.src == stage.id:
            to.append(edge.dst)
        else:
            into = True
    if not to and not into:
        return {}
    return {"gpu_direct_to": tuple(to), "gpu_direct_in": into, "device": stage_device(stage)}
