"""On a GPU: the Thinker's launched decode (its own CUDA stream, ids copied into pinned
host memory, an event polled) gives the greedy ids and hidden rows of its synchronous
step, with the hidden rows on the host or (a GPU-direct or in-group edge) on the device.

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.models.qwen3_omni import create_thinker
from tests.test_models_support import Lockstep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 8
PROMPTS = {"a": [5, 9, 14, 3], "b": [7, 7, 2, 30, 11, 4, 8], "c": [1, 2, 3]}


def _drive(executor: Any, *, launched: bool) -> dict[str, Lockstep]:
    streams = {rid: Lockstep(rid, prompt, accept_hidden_layer=1) for rid, prompt in PROMPTS.items()}
    for step in range(STEPS):
        live = [s for s in streams.values() if not s.is_finished]
        batch = [s.next_item() for s in live]
        if launched:
            pending = executor.launch(batch)
            while not pending.is_done():  # the loop's poll
                pass
            results = pending.result()
        else:
            results = executor.step(batch)
        for stream, result in zip(live, results, strict=True):
            stream.apply(result, is_last=step == STEPS - 1)
    for rid in PROMPTS:
        executor.release(rid)
    return streams


@pytest.mark.parametrize("on_device", [False, True])
def test_launched_decodes_equal_the_steps_on_the_gpu(on_device: bool) -> None:
    args = {"tiny": True, "device": "cuda:0", "max_num_seqs": 4, "max_model_len": 64}
    stepped_executor, launched_executor = create_thinker(**args), create_thinker(**args)
    for executor in (stepped_executor, launched_executor):
        executor.keep_outputs_on_device(on_device)
    stepped = _drive(stepped_executor, launched=False)
    launched = _drive(launched_executor, launched=True)
    assert launched_executor._stream is not None  # the decodes went through the launch
    for rid in PROMPTS:
        assert launched[rid].tokens == stepped[rid].tokens
        for a, b in zip(launched[rid].results, stepped[rid].results, strict=True):
            ha, hb = a.next_stage_output["hidden_layers"], b.next_stage_output["hidden_layers"]
            for layer in ha:
                assert ha[layer].device.type == ("cuda" if on_device else "cpu")
                torch.testing.assert_close(ha[layer], hb[layer])
