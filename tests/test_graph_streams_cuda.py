"""On a GPU: two graph sets replayed at once on two streams (two stages of a device group)
keep their results — each set captured on a stream of its own, so each has its own
cuBLAS workspace (docs/design.md §12).

Small-batch GEMMs with a long inner dimension (a decode step's shape) are where cuBLAS
splits the reduction and keeps partial sums in its workspace. The test also replays two
graphs captured the old way, both on torch's one default capture stream, and prints how
many of their replays came out wrong: not asserted (a race need not show in a given
run), it says whether the shared workspace is a live hazard on the card.

Skipped without CUDA (CI has none): ``python3 -m pytest -q -s tests/test_graph_streams_cuda.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from omnirelay.models.runner.graphs import GraphPool, GraphSet, own_stream, reserved_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPLAYS = 100


def _operands(seed: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda:0").manual_seed(seed)
    a = torch.randn((rows, 16384), generator=gen, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn((16384, width), generator=gen, device="cuda:0", dtype=torch.bfloat16)
    return a, b


def _replay_at_once(replays: Sequence[Callable[[], torch.Tensor]], wants: Sequence[torch.Tensor]) -> int:
    """Each replay ``REPLAYS`` times on a stream of its own, interleaved, nothing
    synchronized between them; how many outputs differ from ``wants``."""
    streams = [own_stream(torch.device("cuda:0"), priority) for priority in (0, -1)][: len(replays)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs: list[list[torch.Tensor]] = [[] for _ in replays]
    for _ in range(REPLAYS):
        for stream, replay, kept in zip(streams, replays, outs):
            with torch.cuda.stream(stream):
                kept.append(replay().clone())  # the graph's output is the next replay's
    torch.cuda.synchronize()
    wrong = 0
    for kept, want in zip(outs, wants):
        for out in kept:
            wrong += not torch.allclose(out.float(), want.float(), rtol=2e-2, atol=1e-2)
    return wrong


def test_two_graph_sets_replayed_at_once_on_two_streams_keep_their_results() -> None:
    device = torch.device("cuda:0")
    (a, b), (c, d) = _operands(0, 16, 1024), _operands(1, 8, 2048)
    wants = [a @ b, c @ d]
    sets = [GraphSet("first", device, enabled=True), GraphSet("second", device, enabled=True, priority=-1)]
    sets[0].capture("mm", lambda: {"out": a @ b})
    sets[1].capture("mm", lambda: {"out": c @ d})
    assert sets[0].stream is not None and sets[1].stream is not None
    assert sets[0].stream.cuda_stream != sets[1].stream.cuda_stream
    replays = [lambda g=g: g.run("mm", lambda: {})["out"] for g in sets]
    assert _replay_at_once(replays, wants) == 0

    # The old way, for the record: both captured on torch's default capture stream.
    graphs, outs = [], []
    for x, y in ((a, b), (c, d)):
        graph = torch.cuda.CUDAGraph()
        x @ y  # warmed up on the current stream
        with torch.cuda.graph(graph):
            outs.append(x @ y)
        graphs.append(graph)

    def old(k: int) -> Callable[[], torch.Tensor]:
        def replay() -> torch.Tensor:
            graphs[k].replay()
            return outs[k]

        return replay

    wrong = _replay_at_once([old(0), old(1)], wants)
    print(f"graphs captured on one stream, replayed at once: {wrong} of {2 * REPLAYS} outputs wrong")


def test_sets_sharing_a_pool_capture_on_one_stream_and_reuse_its_blocks() -> None:
    """Two sets of one stage in one :class:`GraphPool` capture on its one stream, so the
    second set's capture of a step as large as the first's takes no new memory: the
    blocks the first freed were freed on that stream. Two sets with pools of their own
    (the control) each take the step's peak."""
    device = torch.device("cuda:0")
    x = torch.randn((4096, 4096), device=device)

    def step() -> dict[str, torch.Tensor]:
        h = torch.relu(x @ x) + 1  # intermediates freed inside the capture
        return {"y": (h * h).sum(0)}

    def grown(sets: Sequence[GraphSet]) -> list[int]:
        growth = []
        for graphs in sets:
            before = reserved_bytes(device)
            graphs.capture("step", step)
            growth.append(reserved_bytes(device) - before)
        return growth

    pool = GraphPool()
    shared = [GraphSet(name, device, enabled=True, pool=pool) for name in ("window", "stream")]
    own = [GraphSet(name, device, enabled=True) for name in ("window", "stream")]
    shared_growth, own_growth = grown(shared), grown(own)
    assert shared[0].stream is shared[1].stream and own[0].stream is not own[1].stream
    peak = x.numel() * x.element_size()
    print(f"pool growth per set: shared {shared_growth}, own pools {own_growth} (a step's tensor {peak} B)")
    assert shared_growth[0] >= 2 * peak and own_growth[1] >= 2 * peak
    assert shared_growth[1] < peak
    for graphs in (*shared, *own):
        assert torch.equal(graphs.run("step", step)["y"], step()["y"])
