"""The stream step through ``torch.compile``: traced whole (no graph breaks), its state
updated in place inside the compiled function, it decodes what the uncompiled step
decodes — chunk by chunk, streams joining and leaving, a released slot taken by a new
stream — for both decoders (Qwen3-Omni's, with look-ahead; Qwen3-TTS's, fully causal).

The CPU compiles with ``aot_eager`` (dynamo's trace and the functionalized graph, the
same graph inductor would fuse, run by eager kernels: equal to the uncompiled step up to
float rounding); inductor itself runs in the GPU tests (tests/test_vocoder_compiled_cuda.py).
Every step here has the same shape (two streams, three frames each), so the step
compiles once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.runner.vocoder import (
    COMPILE_ENV,
    COMPILED_TOLERANCE,
    StreamingVocoder,
    StreamRow,
    stream_compile_backend,
)
from tests.test_models_support import single_thread, tiny_dir

Q = 16
FRAMES = 3
TOL = 1e-5
#: Which two streams share each step; a stream absent from every later step is released.
SCHEDULE = [("a", "b"), ("a", "b"), ("a", "b"), ("c", "b"), ("c", "b"), ("c", "d"), ("d", "c"), ("d", "c")]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


def _decoder(name: str) -> object:
    if name == "qwen3-omni":
        return Checkpoint.open(tiny_dir()).load_code2wav()
    return TTSCheckpoint.open(TTSModelArgs(tiny=True)).load_codec()


def _whole(model: object, codes: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(codes.unsqueeze(0))[0, 0]  # type: ignore[operator]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-omni", "qwen3-tts"])
def test_the_compiled_step_decodes_what_the_eager_step_decodes(name: str) -> None:
    torch._dynamo.reset()
    model = _decoder(name)
    eager = StreamingVocoder(model, max_streams=2, cuda_graphs=False)
    compiled = StreamingVocoder(model, max_streams=2, cuda_graphs=False, compile="aot_eager")
    assert compiled.compile_backend == "aot_eager" and eager.compile_backend is None
    gen = torch.Generator().manual_seed(4)
    steps_of = {rid: sum(rid in pair for pair in SCHEDULE) for rid in "abcd"}
    codes = {rid: torch.randint(0, 2048, (Q, FRAMES * n), generator=gen) for rid, n in steps_of.items()}
    sent = dict.fromkeys(codes, 0)
    pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in codes}
    with torch.inference_mode():
        for step, pair in enumerate(SCHEDULE):
            rows = [StreamRow(rid, codes[rid][:, sent[rid] : sent[rid] + FRAMES]) for rid in pair]
            want, got = eager.decode(rows), compiled.decode(rows)
            for row, w, g in zip(rows, want, got):
                assert g.shape == w.shape, (step, row.rid)
                assert float((g - w).abs().max()) <= TOL, (step, row.rid)
                pieces[row.rid].append(g)
                sent[row.rid] += FRAMES
            for rid in codes:  # done: its slot goes to the next stream
                if sent[rid] == codes[rid].shape[-1] and rid in compiled.slots:
                    eager.release(rid)
                    compiled.release(rid)
        for rid, c in codes.items():
            whole = _whole(model, c)
            assert float((torch.cat(pieces[rid]) - whole).abs().max()) <= TOL, rid
    assert len(compiled.slots) == 0 and compiled.slots.num_free == 2
    error = compiled.check_compiled()  # the startup probe: two streams of three frames
    assert error is not None and error <= TOL and compiled.compile_backend == "aot_eager"
    assert len(compiled.slots) == 0


@torch._dynamo.register_backend(name="omnirelay_test_doubling")  # type: ignore[untyped-decorator,misc]
def _doubling(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """A backend that computes the step, then doubles its samples (a miscompile)."""

    def run(*args: Any) -> Any:
        return [o * 2 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in graph(*args)]

    return run


@pytest.mark.slow
def test_a_compiled_step_that_decodes_differently_goes_back_to_uncompiled() -> None:
    torch._dynamo.reset()
    model = _decoder("qwen3-tts")
    voc = StreamingVocoder(model, max_streams=2, cuda_graphs=False, compile="omnirelay_test_doubling")
    error = voc.check_compiled()
    assert error is not None and error > COMPILED_TOLERANCE
    assert voc.compile_backend is None and voc.compile_error == error
    assert len(voc.slots) == 0  # the probe's streams are gone
    codes = torch.randint(0, 2048, (Q, FRAMES), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        (got,) = voc.decode([StreamRow("x", codes)])
    assert float((got - _whole(model, codes)).abs().max()) <= TOL


def test_the_switch_compiles_only_graphed_steps_and_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert stream_compile_backend(True) is None
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert stream_compile_backend(True) is None
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert stream_compile_backend(True) == "inductor"
    assert stream_compile_backend(False) is None  # no CUDA graphs: nothing to compile into
    monkeypatch.setenv(COMPILE_ENV, "fast")
    with pytest.raises(ModelError, match=COMPILE_ENV):
        stream_compile_backend(True)
