"""Process roles of the CUDA GPU-direct tests (spawned: importable at module level)."""

from __future__ import annotations

import hashlib
import os
import signal
from typing import Any

import torch


def digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()}"


def consumer(conn: Any, device: str) -> None:
    """Takes each ref it is sent and answers with the tensor's digest (or the error's
    type); ``die`` makes it kill itself before the next take (a reader that crashes)."""
    from omnirelay.connectors.device import DeviceImporter, decode_ref
    from omnirelay.connectors.device.cuda import CudaOpener

    importer = DeviceImporter(CudaOpener(), torch.device(device))
    try:
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            if msg == "die":
                conn.send("dying")
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                conn.send(digest(importer.take(decode_ref(msg))))
            except Exception as exc:  # reported to the test, which asserts on it
                conn.send(f"error:{type(exc).__name__}:{exc}")
    finally:
        importer.close()


def producer(conn: Any, device: str) -> None:
    """Puts one tensor, sends its ref and digest, then waits to be killed."""
    from omnirelay.connectors.device import DeviceProducer, encode_ref
    from omnirelay.connectors.device.cuda import CudaArena

    dp = DeviceProducer(CudaArena(1 << 20, device), producer=f"{os.getpid()}-test", min_bytes=0)
    t = torch.arange(1000, device=device, dtype=torch.float32)
    ref = dp.put("r_0_0", t)
    assert ref is not None
    conn.send((encode_ref(ref), digest(t), dp.handle.producer))
    conn.recv()  # never answered: the test kills this process
