"""GPU-direct edges between stages on GPUs of one host (docs/protocol.md §3.9).

The shm connector moves every tensor through host memory: on an edge between two GPU
stages that is a device→host copy, two host copies and a host→device copy per object.
Here a tensor instead stays on the device:

* :mod:`~omnirelay.connectors.device.paths` — which path each edge takes (what
  ``omnirelay check`` prints): GPU-direct when both of its stages are on CUDA devices;
* :mod:`~omnirelay.connectors.device.pool` — the producer's device buffer pool
  (first-fit blocks of one arena, each with a generation stamp);
* :mod:`~omnirelay.connectors.device.refs` — :class:`DeviceRef`, what the object in the
  shm slot carries instead of the tensor's bytes, validated as untrusted input;
* :mod:`~omnirelay.connectors.device.channel` — :class:`DeviceProducer` (put, release on
  consume / cleanup / dead reader, close) and :class:`DeviceImporter` (open a producer's
  arena once, copy a block out under its stamp check, forget a dead producer), over an
  arena backend;
* :mod:`~omnirelay.connectors.device.cuda` — the CUDA backend: the arena is one device
  allocation exported as a CUDA IPC handle; the importer copies device to device (a peer
  copy when the two stages are on different GPUs).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from omnirelay.connectors.device.paths import EdgePath, cuda_index, edge_path, stage_device

if TYPE_CHECKING:
    from omnirelay.connectors.device.channel import DeviceImporter, DeviceProducer, StaleBlockError
    from omnirelay.connectors.device.pool import Block, DevicePool
    from omnirelay.connectors.device.refs import ArenaHandle, DeviceRef, decode_ref, encode_ref

#: Where the names that need torch (through the payload codec) live: imported on first use,
#: so what only asks which path an edge takes (``omnirelay check``, ``--help``) stays light.
_LAZY = {
    "DeviceImporter": "channel",
    "DeviceProducer": "channel",
    "StaleBlockError": "channel",
    "Block": "pool",
    "DevicePool": "pool",
    "ArenaHandle": "refs",
    "DeviceRef": "refs",
    "decode_ref": "refs",
    "encode_ref": "refs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)


__all__ = [
    "ArenaHandle",
    "Block",
    "DeviceImporter",
    "DevicePool",
    "DeviceProducer",
    "DeviceRef",
    "EdgePath",
    "StaleBlockError",
    "cuda_index",
    "decode_ref",
    "edge_path",
    "encode_ref",
    "stage_device",
]
