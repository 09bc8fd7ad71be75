"""The Thinker's decode launches compiled (``OMNIRELAY_THINKER_COMPILE=1``): the switch
reads as documented and is off by default; a runner whose decode is compiled decodes the
greedy ids of the uncompiled one step after step while requests join and leave (rows in
place and gathered from scattered slots, several batch sizes and attention lengths), its
prefills never compiled (tiny Thinker, CPU; tests/test_runner_frame_compile_cuda.py runs
the inductor case on a GPU)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.models.runner import Buckets, Row, ThinkerRunner, predictor
from omnirelay.models.runner.predictor import use_compile_cache
from omnirelay.models.runner.thinker import THINKER_COMPILE_ENV, decode_compile_backend

STEPS = 10


@pytest.fixture(scope="module")
def checkpoint() -> Any:
    return open_checkpoint(ModelArgs(tiny=True, device="cpu"))


@pytest.fixture(scope="module")
def thinker(checkpoint: Any) -> Any:
    return checkpoint.load_thinker()


def make_runner(model: Any, compile: str | None = None, cuda_graphs: bool = False) -> ThinkerRunner:
    text = getattr(model.model, "language_model", model.model)
    buckets = Buckets(
        max_num_seqs=4, max_model_len=64, batch_sizes=(1, 2, 4), prefill_tokens=(16,), lengths=(16, 32, 64)
    )
    return ThinkerRunner(
        text,
        model.lm_head,
        capture_layers=(0,),
        num_text_ids=200,
        buckets=buckets,
        cuda_graphs=cuda_graphs,
        compile=compile,
    )


def _prompt(i: int) -> list[int]:
    return torch.randint(3, 200, (5 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()


def decode_ids(runner: ThinkerRunner) -> dict[str, list[int]]:
    """Each request's greedy ids: three requests admitted one by one (decode batches 1,
    2 and 3 → bucket 4), one step that leaves out the holder of slot 0 (the others'
    slots are scattered: attention gathers them), the second leaving early (the top
    holder's cache packed into its slot) and a fourth joining; positions past 16 and
    32 (attention lengths 16, 32, 64)."""
    ids: dict[str, list[int]] = {}
    live: list[str] = []

    def admit(i: int) -> None:
        rid = f"r{i}"
        runner.slots.acquire(rid)
        (out,) = runner.run([Row(rid, 0, _prompt(i), SamplingParams(), torch.Generator())], decode=False)
        ids[rid] = [int(out.token)]  # type: ignore[arg-type]
        live.append(rid)

    admit(0)
    for step in range(3 * STEPS):
        if step in (1, 2):
            admit(step)
        if step == 6:
            runner.slots.release("r1")
            live.remove("r1")
            admit(3)
        if not live:
            break
        rows = [r for r in live if not (step == 4 and runner.slots.slot(r) == 0)]
        step_rows = [
            Row(r, runner.slots.length(r), [ids[r][-1]], SamplingParams(), torch.Generator()) for r in rows
        ]
        for r, out in zip(rows, runner.run(step_rows, decode=True), strict=True):
            ids[r].append(int(out.token))  # type: ignore[arg-type]
        for r in [r for r in live if len(ids[r]) == 2 * STEPS]:
            runner.slots.release(r)
            live.remove(r)
    assert runner.slots.holders() == []
    return ids


def test_the_switch_is_off_unless_it_says_1_on_cuda_with_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv(THINKER_COMPILE_ENV, raising=False)
    assert decode_compile_backend(cuda, True) is None  # off by default
    monkeypatch.setenv(THINKER_COMPILE_ENV, "0")
    assert decode_compile_backend(cuda, True) is None
    monkeypatch.setenv(THINKER_COMPILE_ENV, "1")
    assert decode_compile_backend(cuda, True) == "inductor"
    assert decode_compile_backend(cuda, False) is None  # uncaptured shapes would compile while serving
    assert decode_compile_backend(cpu, True) is None
    monkeypatch.setenv(THINKER_COMPILE_ENV, "yes")
    with pytest.raises(ModelError, match=f"{THINKER_COMPILE_ENV} must be 0 or 1"):
        decode_compile_backend(cuda, True)


def test_the_switch_off_leaves_the_stages_decode_uncompiled(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(THINKER_COMPILE_ENV, raising=False)
    args = ModelArgs(tiny=True, device="cpu", runner="static", max_num_seqs=2, max_model_len=64)
    runner = ThinkerExecutor.from_checkpoint(checkpoint, args).runner
    assert runner is not None
    assert runner.decoder.decode_backend is None and runner.compile_cache is None
    assert runner.decoder.decode_forward == runner.decoder.forward
    compiled = make_runner(checkpoint.load_thinker(), compile="aot_eager")
    assert compiled.decoder.decode_backend == "aot_eager"
    assert compiled.decoder.decode_forward != compiled.decoder.forward
    assert "compiling the decode step with aot_eager for batches 1, 2, 4" in compiled._compile_plan()


def test_a_compiled_decode_gives_the_uncompiled_greedy_ids(thinker: Any) -> None:
    """``aot_eager``: the functionalized graph inductor would get, run by eager kernels
    (same sums, so the same ids exactly); one graph per shape, no break in the MoE."""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    with torch.inference_mode():
        want = decode_ids(make_runner(thinker))
        runner = make_runner(thinker, compile="aot_eager")
        compiled = runner.decoder.decode_forward
        shapes: list[tuple[int, int, int, bool]] = []

        def spy(embeds: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            shapes.append((embeds.shape[0], embeds.shape[1], kwargs["attn_len"], kwargs["in_place"]))
            return compiled(embeds, *args, **kwargs)

        runner.decoder.decode_forward = spy
        _dynamo.reset()
        counters.clear()
        got = decode_ids(runner)
    assert got == want
    assert [len(got[r]) for r in ("r0", "r2", "r3")] == [2 * STEPS] * 3 and len(got["r1"]) < 2 * STEPS
    assert {t for _, t, _, _ in shapes} == {1}  # decode launches only: prefills stay uncompiled
    assert {b for b, _, _, _ in shapes} == {1, 2, 4} and {n for _, _, n, _ in shapes} == {16, 32, 64}
    assert {p for _, _, _, p in shapes} == {True, False}  # in place, and gathered from scattered slots
    assert counters["stats"]["unique_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    _dynamo.reset()


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_compiled_decode_keeps_its_kernels_in_a_folder_of_its_own(
    thinker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keyed like the Talker's (model config, torch, device, dtype) under the folder the
    stage chose, named in the startup line, and in use while the graphs compile even
    where another stage of the process pointed inductor elsewhere since."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # restored (unset) after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(predictor, "_OWN_CACHE", None)
    root = use_compile_cache(tmp_path)
    runner = make_runner(thinker, compile="inductor")  # compiles lazily: nothing here
    folder = runner.compile_cache
    assert folder is not None and folder.parent == root
    assert f"first start on this machine: this takes minutes, later starts reuse {folder}" in (
        runner._compile_plan()
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another-stage"))
    with runner._compiling():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "another-stage")
    (folder / "kernel").write_text("")
    assert runner._compile_plan().endswith(f"reusing the kernels cached in {folder}")
