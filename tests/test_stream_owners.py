"""Streams of one process handed to one owner each (``models/runner/graphs.py``).

torch hands its CUDA streams out of a pool in turn, so two stages of a device group (or a
graph set's capture stream and a stage's launch stream) could be given the same stream —
and PyTorch keeps one cuBLAS workspace per stream, which graphs captured on it replay
with. A fake pool that hands its streams out in turn, as torch's does, shows that every
owner gets a stream of its own, that a stream its owner dropped is free again, and that
an exhausted pool is a clear error."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from omnirelay.errors import ModelError
from omnirelay.models.runner.graphs import StreamOwners


@dataclass(frozen=True, eq=False)
class _Stream:
    device_index: int
    cuda_stream: int


def _pool(size: int, device: int = 0) -> tuple[list[int], Callable[[], _Stream]]:
    """A pool of ``size`` streams handed out in turn; ``made`` counts the hand-outs."""
    turn = itertools.cycle(range(size))
    made: list[int] = []

    def make() -> _Stream:
        handle = 1000 + next(turn)
        made.append(handle)
        return _Stream(device, handle)

    return made, make


def test_every_owner_gets_a_stream_no_other_owner_holds() -> None:
    owners = StreamOwners()
    made, make = _pool(4)
    first = owners.take(make)
    # Others take the pool's streams meanwhile (a capture's warm-up stream, a library's):
    # the pool comes round to the first owner's stream again.
    for _ in range(3):
        make()
    second = owners.take(make)
    assert made[-2] == first.cuda_stream  # the pool offered the held stream first
    assert second != first and len(owners) == 2
    third, fourth = owners.take(make), owners.take(make)
    assert len({s.cuda_stream for s in (first, second, third, fourth)}) == 4
    with pytest.raises(ModelError, match=r"no CUDA stream is left .*\(4 held\)"):
        owners.take(make)
    handle = third.cuda_stream
    del third  # its owner (a graph set with its graphs, an executor) is gone
    gc.collect()
    assert len(owners) == 3 and owners.take(make).cuda_stream == handle


def test_streams_of_two_devices_are_apart() -> None:
    owners = StreamOwners()
    _, on_0 = _pool(1, device=0)
    _, on_1 = _pool(1, device=1)
    held = [owners.take(on_0), owners.take(on_1)]  # the same handle on two devices
    assert [s.device_index for s in held] == [0, 1]
    with pytest.raises(ModelError):
        owners.take(on_0)
