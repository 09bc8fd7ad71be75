"""A private CUDA MPS daemon for the length of one benchmark (``bench pipeline --mps``).

Under MPS (Multi-Process Service) the kernels of several processes run on one GPU at
the same time instead of taking turns in time slices; a stage's ``gpu_share`` and
``gpu_priority`` (its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_CLIENT_PRIORITY``)
take effect only then. :func:`mps_daemon` starts ``nvidia-cuda-mps-control -d`` with its
pipe and log directories in a fresh temporary directory, so that only processes started
inside the ``with`` block (they inherit ``CUDA_MPS_PIPE_DIRECTORY``) become its clients
and a daemon someone else runs is never touched; on exit it tells the daemon to quit,
waits (a while) for it to go, and restores the environment. The GPU's own settings (compute mode,
clocks) are left as they are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["CONTROL", "MpsError", "mps_daemon"]

CONTROL = "nvidia-cuda-mps-control"
_VARIABLES = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


class MpsError(RuntimeError):
    """The MPS daemon could not be started (or is not installed)."""


@contextmanager
def mps_daemon(*, control: str = CONTROL, quit_timeout_s: float = 10.0) -> Iterator[dict[str, str]]:
    """Run a private MPS control daemon inside the block; yields the variables its
    clients need (already set in ``os.environ`` for child processes)."""
    exe = shutil.which(control)
    if exe is None:
        raise MpsError(f"{control} is not installed (it comes with the NVIDIA driver's compute utilities)")
    root = Path(tempfile.mkdtemp(prefix="omnirelay-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for path in env.values():
        os.mkdir(path)
    saved = {name: os.environ.get(name) for name in _VARIABLES}
    started = False
    try:
        run = subprocess.run(
            [exe, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30
        )
        if run.returncode != 0:
            raise MpsError(f"{control} -d failed ({run.returncode}): {(run.stderr or run.stdout).strip()}")
        started = True
        os.environ.update(env)
        yield dict(env)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if started:
            _quit(exe, env, root, quit_timeout_s)
        shutil.rmtree(root, ignore_errors=True)


def _quit(exe: str, env: dict[str, str], root: Path, timeout_s: float) -> None:
    """Ask the daemon to quit and wait until its control pipe is gone. The daemon waits
    for its last client: where this process still holds a CUDA context it outlives the
    wait and goes when this process exits (a warning says so; never an error, which
    would lose the run's figures)."""
    control_pipe = root / "pipe" / "control"
    try:
        subprocess.run(
            [exe],
            input="quit\n",
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + timeout_s
    while control_pipe.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if control_pipe.exists():
        print(
            f"omnirelay: the MPS daemon did not stop within {timeout_s:g} s (a client is still attached); "
            "it stops when its last client exits",
            file=sys.stderr,
        )
