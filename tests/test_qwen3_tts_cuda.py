"""On a GPU: the Qwen3-TTS stages' CUDA-graph replays compute what their eager steps compute.

* the reference fixture's Talker (float32): greedy frames from graphs are the reference's
  codes, and seeded frames equal the eager ones; with the code-predictor tail compiled,
  the first frame is the eager one and at least 95 % of the codes agree (fused float math
  may break a tie the other way);
* the tiny 12 Hz decoder: graph windows padded to a bucket equal eager decodes, and
  streams decoded with their state in graph replays are the whole-utterance decode;
* full size (``OMNIRELAY_TEST_FULL_SIZE=1``): the dummy 1.7B CustomVoice Talker's greedy
  frames from graphs match eager ones.

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.qwen3_tts.model_config import TTSConfig
from omnirelay.models.qwen3_tts.seeded import fill_seeded
from omnirelay.models.qwen3_tts.talker import TTSTalkerExecutor
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from omnirelay.models.runner import Buckets
from tests.test_qwen3_tts_talker import item

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FULL_SIZE = os.environ.get("OMNIRELAY_TEST_FULL_SIZE") == "1"
META: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "qwen3_tts" / "reference.json").read_text()
)
CASES = {c["name"]: c for c in META["talker_cases"]}


def _reference_talker(graphs: bool, compile: str | None = None) -> TTSTalkerExecutor:
    config = TTSConfig.from_dict(META["tts_config"])
    with torch.device("cuda:0"):
        talker = TTSTalker(config.talker_config).eval()
    fill_seeded(talker.state_dict(keep_vars=True), META["provenance"]["seed"], prefix="talker.")
    return TTSTalkerExecutor(
        talker,
        config,
        buckets=Buckets(max_num_seqs=4, max_model_len=128),
        cuda_graphs=graphs,
        compile=compile,
    )


def _speak(
    ex: TTSTalkerExecutor, frames: int, sampling: SamplingParams | None = None
) -> dict[str, list[list[int]]]:
    case = CASES["ryan_english"]
    rids = {"a": case, "b": case}
    out: dict[str, list[list[int]]] = {rid: [] for rid in rids}
    for step in range(frames):
        for rid, result in zip(rids, ex.step([item(rid, c, step, sampling) for rid, c in rids.items()])):
            out[rid].append(result.next_stage_output[0].tolist())
    return out


def test_graph_frames_are_the_reference_codes_and_the_eager_frames() -> None:
    graphed = _reference_talker(True)
    assert len(graphed.runner.graphs) > 0
    frames = len(CASES["ryan_english"]["codes"])
    got = _speak(graphed, frames)
    assert got["a"] == got["b"] == CASES["ryan_english"]["codes"]
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=7)
    assert _speak(_reference_talker(True), 12, seeded) == _speak(_reference_talker(False), 12, seeded)
    assert graphed.runner.graphs.num_replays > 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
def test_the_compiled_tail_speaks_the_eager_frames() -> None:
    compiled = _reference_talker(True, compile="inductor")
    assert compiled.runner.predictor.compile_backend == "inductor"
    got, want = _speak(compiled, 14)["a"], _speak(_reference_talker(False), 14)["a"]
    assert got[0] == want[0]
    same = sum(x == y for g, w in zip(got, want) for x, y in zip(g, w))
    assert same >= 0.95 * len(got) * len(got[0])


def _tiny_codec() -> Any:
    return TTSCheckpoint.open(TTSModelArgs(tiny=True, device="cuda:0")).load_codec()


def test_tiny_decoder_graph_windows_equal_eager_decodes() -> None:
    from tests.test_runner_cuda import _window_check

    _window_check(_tiny_codec(), [(1, 4), (2, 29), (3, 50), (16, 64), (5, 17)])


def test_tiny_decoder_streams_with_state_in_graphs_equal_the_whole_utterance() -> None:
    from tests.test_runner_cuda import _stream_check

    _stream_check(_tiny_codec(), [40, 23, 1], [1, 2, 5, 8, 3], 1e-2)


def test_full_size_talker_graph_frames_equal_eager_frames() -> None:
    if not FULL_SIZE:
        pytest.skip("set OMNIRELAY_TEST_FULL_SIZE=1 (needs ~20 GiB of GPU memory)")
    results = {}
    for graphs in (True, False):
        args = TTSModelArgs(
            load_format="dummy",
            device="cuda:0",
            cuda_graphs=graphs,
            compile=False,
            max_num_seqs=4,
            max_model_len=512,
        )
        ex = TTSTalkerExecutor.from_checkpoint(TTSCheckpoint.open(args), args)
        prompt = [151644, 77091, 198, *range(9707, 9720), 151645, 198, 151644, 77091, 198]
        case = {"input_ids": prompt, "speaker": "ryan", "language": "english", "instruct_ids": None}
        results[graphs] = [
            ex.step([item("r", case, step)])[0].next_stage_output[0].tolist() for step in range(12)
        ]
        del ex
        torch.cuda.empty_cache()
    assert results[True][0] == results[False][0]
    same = sum(x == y for g, w in zip(results[True], results[False]) for x, y in zip(g, w))
    assert same >= 0.9 * 12 * 16  # bf16: a tie may break the other way, then the frame differs


@contextmanager
def _synchronizing_is_an_error() -> Iterator[None]:
    """CUDA's sync debug mode set to raise inside, and set back however the block ends
    (torch warns that the mode is a prototype when it is set: not this test's subject)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_launched_step_never_waits_for_the_device_and_speaks_the_stepped_frames() -> None:
    """The Talker's launch split on CUDA: ``runner.launch`` enqueues the step on the
    runner's own stream with no synchronizing call (the sync debug mode turns one into
    an error), the codes land in pinned host memory once the event completed, and the
    frames equal those of ``step``."""
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=7)
    stepped = _speak(_reference_talker(True), 6, seeded)
    ex = _reference_talker(True)
    case = CASES["ryan_english"]
    got: dict[str, list[list[int]]] = {"a": [], "b": []}
    for step in range(6):
        batch = [item(rid, case, step, seeded) for rid in got]
        with torch.inference_mode():
            prefills, decodes, seqs = ex._rows(batch)
            torch.cuda.synchronize()  # the rows' own work (conditioning) is not the launch's
            with _synchronizing_is_an_error():
                frames = ex.runner.launch(prefills, decodes)
        while not frames.is_done():
            pass
        codes = frames.codes()
        assert codes.is_pinned()
        for it, result in zip(batch, ex._results(batch, seqs, [*prefills, *decodes], codes)):
            got[it.internal_id].append(result.next_stage_output[0].tolist())
    assert got == stepped
    for rid in got:
        ex.release(rid)
    assert ex.leak_state() == {}
    # The executor's launch (rows prepared on the Talker's stream) speaks the same frames.
    ex = _reference_talker(True)
    launched: dict[str, list[list[int]]] = {"a": [], "b": []}
    for step in range(6):
        pending = ex.launch([item(rid, case, step, seeded) for rid in launched])
        while not pending.is_done():
            pass
        for rid, result in zip(launched, pending.result()):
            launched[rid].append(result.next_stage_output[0].tolist())
    assert launched == stepped
