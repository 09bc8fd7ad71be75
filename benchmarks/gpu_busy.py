"""How busy a GPU was during a measurement: :class:`BusySampler`.

The device's busy share is the share of wall time during which at least one kernel ran
on it (NVML's ``utilization.gpu``, whatever process launched the kernel), read by
``nvidia-smi`` every ``interval_ms`` while the sampler runs. With the sum of the stages'
step times over the same span it says what remains: a busy share well under 100 %
with work queued is time the device waited for the host; a step-time sum above the
busy share is work that overlapped.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from types import TracebackType

from omnirelay.connectors.device import cuda_index

__all__ = ["BusySampler"]


class BusySampler:
    """``with BusySampler("cuda:0") as s: ...`` then ``s.share`` (0–1; None when the
    device is not a CUDA device or ``nvidia-smi`` is not there)."""

    def __init__(self, device: str | None, interval_ms: int = 100) -> None:
        index = cuda_index(device)
        self._cmd: list[str] | None = None
        tool = shutil.which("nvidia-smi")
        if index is not None and tool is not None:
            self._cmd = [
                tool,
                f"--id={index}",
                "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits",
                f"--loop-ms={interval_ms}",
            ]
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self.samples: list[float] = []

    def __enter__(self) -> BusySampler:
        if self._cmd is not None:
            self._proc = subprocess.Popen(
                self._cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            self._reader = threading.Thread(target=self._read, name="omnirelay-gpu-busy", daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append(float(line.strip()) / 100.0)
            except ValueError:
                continue

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5.0)

    @property
    def share(self) -> float | None:
        """The mean busy share over the samples (None: none taken)."""
        return sum(self.samples) / len(self.samples) if self.samples else None
