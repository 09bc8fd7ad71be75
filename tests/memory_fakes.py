"""A fake CUDA device's memory for the KV-sizing tests: what a device budget reads
(:mod:`omnirelay.models.runner.memory`) without a GPU."""

from __future__ import annotations

GIB = 2**30


class FakeMemory:
    """A device of 80 GiB whose allocations the fake builds and captures record."""

    def __init__(self, in_use_gib: float) -> None:
        self.allocated_bytes = int(in_use_gib * GIB)
        self.pools = 0

    def free_and_total(self) -> tuple[int, int]:
        return 80 * GIB - self.allocated_bytes - self.pools, 80 * GIB

    def allocated(self) -> int:
        return self.allocated_bytes

    def reserved(self) -> int:
        return self.allocated_bytes + self.pools
