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
from tests.test_moe_fused import interpreted, needs_triton

__all__ = ["interpreted"]  # the Triton interpreter's fixture, shared with the fused experts' tests

STEPS = 7


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
    return torch.randint(3, 200, (8 + 4 * i,), generator=torch.Generator().manual_seed(i)).tolist()


def lockstep(runners: list[ThinkerRunner]) -> tuple[list[dict[str, list[int]]], list[torch.Tensor]]:
    """The same requests on each of ``runners``, fed the ids the first one picks: three
    admitted one by one (decode batches 1, 2 and 3 → bucket 4), one step that leaves out
    the holder of slot 0 (the others' slots are scattered: attention gathers them), the
    second leaving early (the top holder's cache packed into its slot) and a fourth
    joining; positions past 16 and 32 (attention lengths 16, 32, 64). Returns each
    runner's greedy ids per request, and per runner its decode steps' logits ``[rows, V]``
    stacked (float32)."""
    ids: list[dict[str, list[int]]] = [{} for _ in runners]
    logits: list[list[torch.Tensor]] = [[] for _ in runners]
    live: list[str] = []
    lead = runners[0]

    def step(rows: list[str], tokens: dict[str, list[int]], decode: bool) -> None:
        for n, runner in enumerate(runners):
            batch = [
                Row(r, runner.slots.length(r), tokens[r], SamplingParams(), torch.Generator()) for r in rows
            ]
            outs = runner.run(batch, decode=decode, keep_logits=decode)
            for r, out in zip(rows, outs, strict=True):
                ids[n].setdefault(r, []).append(int(out.token))  # type: ignore[arg-type]
            if decode:
                logits[n].append(torch.stack([out.logits for out in outs]).float().cpu())  # type: ignore[misc]

    def admit(i: int) -> None:
        rid = f"r{i}"
        for runner in runners:
            runner.slots.acquire(rid)
        step([rid], {rid: _prompt(i)}, decode=False)
        live.append(rid)

    def leave(rid: str) -> None:
        for runner in runners:
            runner.slots.release(rid)
        live.remove(rid)

    admit(0)
    for n in range(3 * STEPS):
        if n in (1, 2):
            admit(n)
        if n == 6:
            leave("r1")
            admit(3)
        if not live:
            break
        rows = [r for r in live if not (n == 4 and lead.slots.slot(r) == 0)]
        step(rows, {r: [ids[0][r][-1]] for r in rows}, decode=True)
        for r in [r for r in live if len(ids[0][r]) == 2 * STEPS]:
            leave(r)
    for runner in runners:
        assert runner.slots.holders() == []
    return ids, [torch.cat([x.flatten() for x in per]) for per in logits]


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
    """Dynamo's ``eager`` backend: the pass traced as inductor would get it, whole, and run
    by the same kernels (so the same ids exactly); one graph per shape, no break in the MoE.
    That the functionalized pass still writes the cache in place is the shared
    ``compile_decode``'s, checked with inductor in tests/test_runner_frame_compile.py."""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    with torch.inference_mode():
        plain = make_runner(thinker)
        runner = make_runner(thinker, compile="eager")
        compiled = runner.decoder.decode_forward
        shapes: list[tuple[int, int, int, bool]] = []

        def spy(embeds: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            shapes.append((embeds.shape[0], embeds.shape[1], kwargs["attn_len"], kwargs["in_place"]))
            return compiled(embeds, *args, **kwargs)

        runner.decoder.decode_forward = spy
        _dynamo.reset()
        counters.clear()
        (want, got), (want_logits, got_logits) = lockstep([plain, runner])
    assert got == want
    assert [len(got[r]) for r in ("r0", "r2", "r3")] == [2 * STEPS] * 3 and len(got["r1"]) < 2 * STEPS
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)
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


def test_the_runner_bench_records_the_switch_and_compares_compiled_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``bench runner`` with the switch on: the switch in the report, the backend named,
    the compiled decode's greedy ids against the uncompiled pass's (dynamo's ``eager``
    backend stands for inductor on the CPU: the figures, not the kernels, are under test),
    and the experts paths still counted from the uncompiled pass."""
    from benchmarks.runner import render_runner_bench, run_runner_bench
    from omnirelay.models.runner import thinker as thinker_runner

    monkeypatch.setenv(THINKER_COMPILE_ENV, "1")
    monkeypatch.setattr(thinker_runner, "decode_compile_backend", lambda device, graphs: "eager")
    report = run_runner_bench(device="cpu", reps=1, stages=("thinker",), tiny=True, sizes=(2,))
    assert report["switches"] == {THINKER_COMPILE_ENV: "1"}
    figures = report["thinker"]
    assert figures["decode_compile"] == "eager"
    assert figures["compiled_ids_agreement"] == 1.0 and figures["greedy_ids_equal"]
    assert figures["decode_2"]["experts_per_layer"] >= 1 and figures["decode_2"]["graph_ms"] > 0
    text = render_runner_bench(report)
    assert f"switches: {THINKER_COMPILE_ENV}=1" in text and "decode_compile eager" in text


@needs_triton
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_fused_moe_runs_inside_the_compiled_decode_as_one_operator(
    interpreted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused Triton MoE path (interpreted on the CPU, bfloat16) inside the compiled
    decode: one opaque operator per block, so the pass compiles with no graph break (a
    break would split it per layer, a compile per layer index); the ids and logits of the
    uncompiled runner, rows in place and gathered; its blocks counted where they ran."""
    from torch import _dynamo
    from torch._dynamo.utils import counters

    from omnirelay.models.runner import moe
    from omnirelay.models.runner import thinker as thinker_runner

    model = open_checkpoint(ModelArgs(tiny=True, device="cpu", dtype="bfloat16")).load_thinker()
    assert moe.fused_experts_enabled(torch.bfloat16)
    monkeypatch.setattr(thinker_runner, "experts_for", lambda device, dtype, b, t: moe.FUSED_EXPERTS)
    text = getattr(model.model, "language_model", model.model)
    blocks = sum(hasattr(layer.mlp, "experts") for layer in text.layers)
    runners = [make_runner(model), make_runner(model, compile="aot_eager")]
    ids: list[list[int]] = [[], []]
    logits: list[list[torch.Tensor]] = [[], []]
    _dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        for n, runner in enumerate(runners):
            for i, rid in enumerate(("a", "b")):
                runner.slots.acquire(rid)
                runner.run([Row(rid, 0, _prompt(i), SamplingParams(), torch.Generator())], decode=False)
            before = moe.CALLS["block"]
            for rows in (("a", "b"), ("a", "b"), ("b",)):  # the last: slot 1 alone, gathered
                batch = [
                    Row(r, runner.slots.length(r), [7], SamplingParams(), torch.Generator()) for r in rows
                ]
                outs = runner.run(batch, decode=True, keep_logits=True)
                ids[n] += [int(out.token) for out in outs]  # type: ignore[arg-type]
                logits[n] += [out.logits for out in outs]  # type: ignore[misc]
            assert moe.CALLS["block"] - before == 3 * blocks  # three decode launches, every block fused
    assert ids[1] == ids[0]
    torch.testing.assert_close(torch.stack(logits[1]), torch.stack(logits[0]), rtol=0, atol=1e-2)
    assert counters["stats"]["unique_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    _dynamo.reset()
