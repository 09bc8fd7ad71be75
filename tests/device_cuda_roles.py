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


def shm_consumer(conn: Any, namespace: str, device: str) -> None:
    """The receiving stage of a GPU-direct shm edge. Commands: ``("get", key)`` waits for
    the object and answers (status, error, {name: (digest, device)}); ``("get_once", key)``
    answers one get's status; ``("die_in_copy", key)`` kills itself inside the claim, where
    the device copy would start (a reader that crashes mid-read); ``"stop"``."""
    from omnirelay.connectors.shm.connector import ShmConnector

    torch.cuda.set_device(device)
    shm = ShmConnector(namespace, 2, gpu_direct_in=True, device=device, sweep_on_start=False)
    try:
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            op, key = msg
            if op == "die_in_copy":

                def die(*_: Any) -> torch.Tensor:
                    conn.send("dying")
                    os.kill(os.getpid(), signal.SIGKILL)
                    raise AssertionError("unreachable")

                shm._reader._device = die
            got = shm.get(1, 2, key)
            if op == "get":
                while got.status.value == "not_yet":
                    shm.wait_arrivals(2, timeout=1.0)
                    got = shm.get(1, 2, key)
            tensors = {}
            if got.is_ready:
                tensors = {k: (digest(t), str(t.device)) for k, t in got.obj.items()}
            conn.send((got.status.value, got.error, tensors))
    finally:
        shm.close()
