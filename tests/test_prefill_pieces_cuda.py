"""On a GPU: the tiny Thinker on its static runner (CUDA graphs for the decodes) gives
the same greedy tokens and Talker rows for a prompt prefilled in pieces as in one step,
with other requests' launched decodes in the same steps, the rows on the host or on the
device, and frees every KV slot at the end.

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.engine import ARScheduler, Request, SamplingParams
from omnirelay.models.qwen3_omni import create_thinker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LONG = [(7 * i + 3) % 200 + 10 for i in range(45)]
SHORT = [5, 9, 14, 3]


def _drive(executor: Any, cap: int | None) -> dict[str, Any]:
    sched = ARScheduler(
        stage_id=0,
        max_num_seqs=4,
        receives_chunks=False,
        supports_batching=True,
        clock=lambda: 0.0,
        max_prefill_piece_tokens=cap,
    )
    reqs = {
        name: Request(
            internal_id=f"{name}@s0.1",
            external_id=name,
            stage_id=0,
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=n),
            arrival_time=0.0,
        )
        for name, prompt, n in (("short", SHORT, 16), ("long", LONG, 4))
    }
    sched.add_request(reqs["short"])
    first: dict[str, Any] = {}
    added = False
    while sched.requests:
        if reqs["short"].output_token_ids and not added:  # long comes while short decodes
            sched.add_request(reqs["long"])
            added = True
        out = sched.schedule()
        results = []
        for batch in out.batches:
            pending = executor.launch(list(batch))  # as a device group's loop does
            while not pending.is_done():
                pass
            results.append(pending.result())
        for u in sched.update_from_output(out, results).updates:
            if u.next_stage_output is not None:
                first.setdefault(u.request.external_id, u.next_stage_output)
            if u.is_finished:
                executor.release(u.request.internal_id)
    assert sched.leak_state() == {} and executor.num_live_requests() == 0
    assert executor.runner is not None and executor.runner.slots.num_free == 4
    return {"tokens": {k: r.output_token_ids for k, r in reqs.items()}, "first": first}


@pytest.mark.parametrize("on_device", [False, True])
def test_a_prompt_in_pieces_equals_one_piece_on_the_gpu(on_device: bool) -> None:
    executor = create_thinker(tiny=True, device="cuda:0", max_num_seqs=4, max_model_len=128)
    assert executor.runner is not None
    executor.keep_outputs_on_device(on_device)
    whole = _drive(executor, None)
    split = _drive(executor, 8)
    assert split["tokens"] == whole["tokens"]
    got, want = split["first"]["long"], whole["first"]["long"]
    assert got["token_ids"] == want["token_ids"]
    for layer, rows in want["hidden_layers"].items():
        assert rows.shape[0] == len(LONG)
        assert got["hidden_layers"][layer].device.type == ("cuda" if on_device else "cpu")
        torch.testing.assert_close(got["hidden_layers"][layer], rows, rtol=1e-4, atol=1e-4)
