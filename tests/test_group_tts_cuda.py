"""On a GPU: a Qwen3-TTS Talker and Code2Wav driven as a device group drives them —
each step launched on its own stream while the other stage's step is on the GPU, nothing
synchronized, releases (and the slot moves they make) issued while the other stage's
work is in flight — answer exactly what the same steps answer run one after the other
(the process-per-stage path: ``step`` on the default stream).

Twenty requests of staggered lengths join every other round; Code2Wav decodes each
stream's frames in chunks of one to three frames, so its steps mix frame buckets, and
requests leave out of order, so both stages move slots. Every Talker frame must be the
stepped run's and every stream's audio the stepped run's; both stages end with nothing
held. Run it with ``CUDA_LAUNCH_BLOCKING`` unset (the overlap is the point); a failure
names the request and the round.

Skipped without CUDA (CI has none); run on a GPU machine:
``python3 -m pytest -q tests/test_group_tts_cuda.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.models.code2wav import Code2WavExecutor
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
from omnirelay.models.qwen3_tts.model_config import TTSConfig
from omnirelay.models.qwen3_tts.seeded import fill_seeded
from omnirelay.models.qwen3_tts.talker import TTSTalkerExecutor
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from omnirelay.models.runner import Buckets
from omnirelay.payload import Codes, Meta, OmniPayload
from tests.test_models_support import item as chunk_item
from tests.test_qwen3_tts_talker import item as talker_item

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
META: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "qwen3_tts" / "reference.json").read_text()
)
NUM_REQUESTS = 20
SLOTS = 8


@dataclass
class _Request:
    rid: str
    case: dict[str, Any]
    joins: int  # the round it joins the Talker
    frames: int  # frames it speaks before it is released (or its codec EOS)
    chunk: int  # frames per Code2Wav chunk
    spoken: list[list[int]] = field(default_factory=list)
    pending: list[list[int]] = field(default_factory=list)  # frames not yet sent to Code2Wav
    audio: list[torch.Tensor] = field(default_factory=list)
    talking: bool = False
    done_talking: bool = False


def _requests() -> list[_Request]:
    cases = META["talker_cases"]
    return [
        _Request(f"r{i}", cases[i % len(cases)], joins=2 * i, frames=5 + (7 * i) % 11, chunk=1 + i % 3)
        for i in range(NUM_REQUESTS)
    ]


def _stages() -> tuple[TTSTalkerExecutor, Code2WavExecutor]:
    config = TTSConfig.from_dict(META["tts_config"])
    with torch.device("cuda:0"):
        model = TTSTalker(config.talker_config).eval()
    fill_seeded(model.state_dict(keep_vars=True), META["provenance"]["seed"], prefix="talker.")
    talker = TTSTalkerExecutor(
        model, config, buckets=Buckets(max_num_seqs=SLOTS, max_model_len=128), cuda_graphs=True
    )
    codec = TTSCheckpoint.open(TTSModelArgs(tiny=True, device="cuda:0")).load_codec()
    # Code2Wav holds a stream until its last chunk is decoded, a round or two after the Talker let go.
    return talker, Code2WavExecutor(codec, cuda_graphs=True, max_streams=2 * SLOTS)


def _count_moves(talker: TTSTalkerExecutor, code2wav: Code2WavExecutor) -> dict[str, int]:
    moves = {"talker": 0, "code2wav": 0}
    for name, table in (("talker", talker.runner.slots), ("code2wav", code2wav.vocoder.slots)):  # type: ignore[union-attr]
        inner = table.on_move
        assert inner is not None

        def counted(src: int, dst: int, length: int, name: str = name, inner: Any = inner) -> None:
            moves[name] += 1
            inner(src, dst, length)

        table.on_move = counted
    return moves


class _Run:
    """The rounds both drives share: who steps in the Talker, which chunks go to Code2Wav,
    and what each result means."""

    def __init__(self, talker: TTSTalkerExecutor, code2wav: Code2WavExecutor) -> None:
        self.talker, self.code2wav = talker, code2wav
        self.requests = {r.rid: r for r in _requests()}
        self.eos = talker.config.talker_config.codec_eos_token_id

    def talker_batch(self, round_: int) -> list[BatchItem]:
        batch = []
        for r in self.requests.values():
            if not r.done_talking and r.joins <= round_ and (r.talking or len(self.live()) < SLOTS):
                r.talking = True
                batch.append(talker_item(r.rid, r.case, len(r.spoken)))
        return batch

    def live(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if r.talking and not r.done_talking]

    def took_frames(self, results: list[ItemResult]) -> list[str]:
        """The Talker's results; the requests that stop talking (to release)."""
        ended = []
        for result in results:
            r = self.requests[result.internal_id]
            frame = result.next_stage_output[0].tolist()
            r.spoken.append(frame)
            if frame[0] != self.eos:
                r.pending.append(frame)
            if result.finished or len(r.spoken) == r.frames:
                r.done_talking = True
                ended.append(r.rid)
        return ended

    def code2wav_batch(self) -> tuple[list[BatchItem], list[str]]:
        """Chunks of streams with a chunk's frames (or their last ones); the streams whose
        last chunk this is (to release once decoded)."""
        batch, last = [], []
        for r in self.requests.values():
            if r.pending and (len(r.pending) >= r.chunk or r.done_talking):
                codes = torch.tensor(r.pending, dtype=torch.long).T.contiguous()  # [Q, n]
                r.pending = []
                payload = OmniPayload(codes=Codes(audio=codes), meta=Meta(left_context_size=0))
                ids, info = Code2WavExecutor.read_chunk(None, payload)
                batch.append(chunk_item(r.rid, input_ids=ids, info=info))
                if r.done_talking:
                    last.append(r.rid)
        return batch, last

    def took_audio(self, results: list[ItemResult]) -> None:
        for result in results:
            self.requests[result.internal_id].audio.append(result.audio.clone())

    def is_over(self) -> bool:
        return all(r.done_talking and not r.pending for r in self.requests.values())


def _stepped(run: _Run) -> None:
    """The process-per-stage path: each stage's step to its end, on the default stream.
    A round's Code2Wav chunks hold the frames of the rounds before it, as when launched."""
    round_ = 0
    while not run.is_over():
        batch = run.talker_batch(round_)
        chunks, last = run.code2wav_batch()
        for rid in run.took_frames(run.talker.step(batch) if batch else []):
            run.talker.release(rid)
        if chunks:
            run.took_audio(run.code2wav.step(chunks))
        for rid in last:
            run.code2wav.release(rid)
        round_ += 1


def _launched(run: _Run, poll: Callable[[Any], None]) -> int:
    """The device group's way: the Talker launched; Code2Wav's last step completed and
    its ended streams released while the Talker's step is on the GPU; Code2Wav launched
    behind it; then the Talker completed and its ended requests released while
    Code2Wav's step is on the GPU. Returns how many Code2Wav launches found the Talker's
    step still running."""
    round_, overlapped = 0, 0
    decoding: Any = None
    decoding_last: list[str] = []
    while not run.is_over() or decoding is not None:
        batch = run.talker_batch(round_)
        talking = run.talker.launch(batch) if batch else None
        if decoding is not None:
            poll(decoding)
            run.took_audio(decoding.result())
            for rid in decoding_last:
                run.code2wav.release(rid)  # slot moves on Code2Wav's stream, the Talker in flight
            decoding = None
        chunks, decoding_last = run.code2wav_batch()
        if chunks:
            decoding = run.code2wav.launch(chunks)
            overlapped += talking is not None and not talking.is_done()
        if talking is not None:
            poll(talking)
            for rid in run.took_frames(talking.result()):
                run.talker.release(rid)  # slot moves on the default stream, Code2Wav in flight
        round_ += 1
    return overlapped


def _spin(pending: Any) -> None:
    while not pending.is_done():
        pass


def test_a_launched_talker_and_code2wav_answer_what_their_stepped_runs_answer() -> None:
    talker, code2wav = _stages()
    moves = _count_moves(talker, code2wav)
    with torch.inference_mode():
        stepped = _Run(talker, code2wav)
        _stepped(stepped)
        assert talker.leak_state() == {} and code2wav.leak_state() == {}
        assert moves["talker"] > 0 and moves["code2wav"] > 0, moves  # requests left out of order
        launched = _Run(talker, code2wav)
        overlapped = _launched(launched, _spin)
    torch.cuda.synchronize()
    for rid, want in stepped.requests.items():
        got = launched.requests[rid]
        assert got.spoken == want.spoken, f"{rid}: the Talker's frames differ"
        assert len(got.audio) == len(want.audio), rid
        for k, (a, b) in enumerate(zip(got.audio, want.audio)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{rid}: audio chunk {k} differs")
    assert talker.leak_state() == {} and code2wav.leak_state() == {}
    assert sum(len(r.audio) for r in launched.requests.values()) > NUM_REQUESTS
    # Each graph set captured on a stream of its own, none of them a launch stream: a
    # cuBLAS workspace is one per stream, and a graph replays with its capture stream's.
    vocoder = code2wav.vocoder
    assert vocoder is not None
    sets = [talker.runner.graphs, code2wav._decoder.graphs, vocoder.graphs]
    streams = [g.stream for g in sets if len(g)] + [talker.runner.stream(), code2wav._stream]
    assert all(s is not None for s in streams) and len(streams) == 5
    assert len({s.cuda_stream for s in streams if s is not None}) == 5
    print(f"slot moves {moves}; {overlapped} Code2Wav launches while the Talker's step ran")
