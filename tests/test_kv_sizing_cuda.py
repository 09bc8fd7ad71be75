"""On a GPU: the tiny Qwen3-Omni Thinker and Talker built in one process size their KV
slots from the device's real memory (capped by the stage's max_num_seqs), every KV is
allocated before any graph is captured, and the sized runners still decode.

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni import create_talker, create_thinker
from omnirelay.models.runner import Row
from omnirelay.models.runner.memory import CudaMemory, DeviceBudget, activate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_tiny_stages_size_their_slots_from_the_device() -> None:
    lines: list[str] = []
    budget = DeviceBudget("cuda:0", 0.9)
    args = {"tiny": True, "device": "cuda:0", "max_model_len": 256, "compile": False}
    with activate(budget):
        budget.stage = ("thinker", 6)
        thinker = create_thinker(**args)
        budget.stage = ("talker", 12)
        talker = create_talker(**args)
    assert thinker.runner is None and talker.runner is None
    free_before, _ = CudaMemory("cuda:0").free_and_total()
    assert budget.finish(lines.append) == {"thinker": 6, "talker": 6}
    assert thinker.runner is not None and talker.runner is not None
    assert thinker.runner.slots.num_slots == 6 and talker.runner.slots.num_slots == 6
    assert len(thinker.runner.graphs) > 0 and len(talker.runner.graphs) > 0
    assert [line.split(" on ")[0] for line in lines] == ["omnirelay: thinker", "omnirelay: talker"]
    assert all("KV 6 slots x 256 positions" in line for line in lines)
    free_after, _ = CudaMemory("cuda:0").free_and_total()
    assert free_after < free_before
    runner = thinker.runner
    runner.slots.acquire("x")
    (out,) = runner.run([Row("x", 0, [5, 6, 7], SamplingParams(), torch.Generator())], decode=False)
    assert out.token is not None


def test_a_share_too_small_for_one_slot_is_one_line() -> None:
    budget = DeviceBudget("cuda:0", 0.01)  # below what the context alone takes
    with activate(budget):
        budget.stage = ("thinker", 8)
        create_thinker(tiny=True, device="cuda:0", max_model_len=256)
    with pytest.raises(ModelError, match=r"not even one KV slot fits: .* GiB short.*gpu_memory_utilization"):
        budget.finish(lambda line: None)
