"""Thinker → Talker processor: first-chunk delay rule, payload contents, shapes (docs/protocol.md §5.1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.errors import ConfigError, PayloadEncodeError
from omnirelay.payload import OmniPayload
from omnirelay.processors import ThinkerStreamState, ThinkerToTalkerProcessor
from omnirelay.transfer import ReleaseScope

H = 8
ACCEPT = 24
PROMPT = [151644, 872, 11, 12, 13]


def rows(start: int, n: int, *, scale: float = 1.0) -> torch.Tensor:
    """n distinct rows [n, H] for positions start…start+n-1."""
    pos = torch.arange(start, start + n, dtype=torch.float32).reshape(n, 1)
    return (pos * 10 + torch.arange(H, dtype=torch.float32)) * scale


def layers(start: int, n: int, *, str_keys: bool = False) -> dict[Any, torch.Tensor]:
    emb, hid = rows(start, n), rows(start, n, scale=-1.0)
    return {"0": emb, str(ACCEPT): hid} if str_keys else {0: emb, ACCEPT: hid}


class Stream:
    """Drives one request the way the transfer adapter does (chunk id = payloads put)."""

    def __init__(self, processor: ThinkerToTalkerProcessor, state: ThinkerStreamState) -> None:
        self.processor = processor
        self.state = state
        self.payloads: list[OmniPayload] = []
        #: The finish flag the adapter's envelope carried with each payload.
        self.finished: list[bool] = []
        self.token_ids = list(state.prompt_ids)

    def step(self, hidden: Any, *, finished: bool = False, new_token: int | None = None, **kw: Any) -> Any:
        if new_token is not None:
            self.token_ids.append(new_token)
        out = self.processor.step(
            self.state, hidden, chunk_id=len(self.payloads), finished=finished, token_ids=self.token_ids, **kw
        )
        if out is not None:
            assert type(out) is OmniPayload
            self.payloads.append(out)
            self.finished.append(finished)
        return out


def present(payload: OmniPayload) -> set[str]:
    """The payload's fields that are set."""
    return {f for f in OmniPayload.__struct_fields__ if getattr(payload, f) is not None}


def new_stream(**kw: Any) -> Stream:
    processor = ThinkerToTalkerProcessor(accept_hidden_layer=ACCEPT)
    return Stream(processor, processor.new_state(PROMPT, speaker="Ethan", language="en", **kw))


def tts() -> dict[str, torch.Tensor]:
    return {
        "tts_bos": torch.full((H,), 1.0),
        "tts_eos": torch.full((1, H), 2.0),
        "tts_pad": torch.full((H,), 3.0),
    }


def test_chunk_0_waits_for_prompt_plus_one_generated_position() -> None:
    stream = new_stream()
    # Prefill: exactly the prompt's rows. Not enough: the Talker needs one generated position.
    assert stream.step(layers(0, len(PROMPT)), new_token=500, **tts()) is None
    assert stream.state.num_cached_rows == len(PROMPT)
    # First decode step: prompt + 1 rows → chunk 0 is released with everything cached.
    chunk0 = stream.step(layers(len(PROMPT), 1), new_token=501)
    assert chunk0 is not None
    n = len(PROMPT) + 1
    assert torch.equal(chunk0.embed["prefill"], rows(0, n))
    assert torch.equal(chunk0.hidden_states["output"], rows(0, n, scale=-1.0))
    assert torch.equal(chunk0.embed["tts_bos"], torch.full((1, H), 1.0))
    assert torch.equal(chunk0.embed["tts_eos"], torch.full((1, H), 2.0))
    assert torch.equal(chunk0.embed["tts_pad"], torch.full((1, H), 3.0))
    assert chunk0.ids == {"all": [*PROMPT, 500, 501], "prompt": PROMPT}
    assert chunk0.meta is None and stream.finished == [False]  # the envelope says it is not the last
    assert chunk0.speaker == "Ethan" and chunk0.language == "en"
    assert stream.state.num_cached_rows == 0 and not stream.state.cached_embed


def test_chunked_prefill_accumulates_until_the_prompt_is_covered() -> None:
    stream = new_stream()
    assert stream.step(layers(0, 2)) is None
    assert stream.step(layers(2, 3)) is None  # whole prompt, still no generated position
    chunk0 = stream.step(layers(5, 1), new_token=9)
    assert chunk0 is not None
    assert torch.equal(chunk0.embed["prefill"], rows(0, 6))
    assert "tts_bos" not in chunk0.embed  # absent embeddings are left out


def test_finish_releases_chunk_0_early() -> None:
    stream = new_stream()
    out = stream.step(layers(0, 3), finished=True)
    assert out is not None and stream.finished == [True]
    assert torch.equal(out.embed["prefill"], rows(0, 3))
    assert stream.state.is_finished
    with pytest.raises(PayloadEncodeError, match="after the stream finished"):
        stream.step(layers(3, 1))


def test_decode_chunks_carry_one_row_of_layer_0_and_no_hidden_states() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT)))
    stream.step(layers(5, 1))
    out = stream.step(layers(6, 1), new_token=7)
    assert out is not None
    assert present(out) == {"embed", "speaker", "language"}
    assert torch.equal(out.embed["decode"], rows(6, 1))
    assert stream.finished[-1] is False


def test_multi_row_decode_output_is_sent_not_dropped() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT)))
    stream.step(layers(5, 1))
    out = stream.step(layers(6, 3))
    assert out is not None
    assert torch.equal(out.embed["decode"], rows(6, 3))


def test_decode_steps_may_omit_the_accept_layer() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT)))
    stream.step(layers(5, 1))
    out = stream.step({0: rows(6, 1)})
    assert out is not None and torch.equal(out.embed["decode"], rows(6, 1))


def test_layers_are_found_by_int_or_str_key() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT), str_keys=True))
    out = stream.step(layers(5, 1, str_keys=True))
    assert out is not None and out.embed["prefill"].shape == (6, H)
    assert stream.step({"0": rows(6, 1)}) is not None


def test_empty_finishing_decode_step_sends_a_terminal() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT)))
    stream.step(layers(5, 1))
    assert stream.step({0: torch.empty(0, H)}) is None
    terminal = stream.step({0: torch.empty(0, H)}, finished=True)
    assert terminal is not None and present(terminal) == {"speaker", "language"} and stream.finished[-1]


def test_one_dimensional_layer_output_is_one_row() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT)))
    stream.step({0: rows(5, 1)[0], ACCEPT: rows(5, 1)[0]})
    out = stream.step({0: rows(6, 1)[0]})
    assert out is not None and out.embed["decode"].shape == (1, H)


@pytest.mark.parametrize(
    ("hidden", "match"),
    [
        ([rows(0, 1)], "must map layer index -> tensor"),
        ({ACCEPT: rows(0, 1)}, "embedding layer 0 was not captured"),
        ({0: rows(0, 1)}, "accept_hidden_layer 24 was not captured"),
        ({0: rows(0, 2), ACCEPT: rows(0, 1)}, "layer 0 has 2 row"),
        ({0: torch.ones(1, 2, H), ACCEPT: rows(0, 1)}, r"must be \[rows, hidden\]"),
        ({0: torch.ones(1, H, dtype=torch.long), ACCEPT: rows(0, 1)}, "floating point"),
        ({0: [1.0] * H, ACCEPT: rows(0, 1)}, "must be a tensor"),
    ],
)
def test_bad_step_outputs_raise_clear_errors(hidden: Any, match: str) -> None:
    with pytest.raises(PayloadEncodeError, match=match):
        new_stream().step(hidden)


def test_width_changes_between_steps_are_errors() -> None:
    stream = new_stream()
    stream.step(layers(0, len(PROMPT)))
    stream.step(layers(5, 1))
    with pytest.raises(PayloadEncodeError, match="has width 4, earlier steps had 8"):
        stream.step({0: torch.ones(1, 4)})


def test_bad_tts_embedding_is_an_error() -> None:
    with pytest.raises(PayloadEncodeError, match=r"tts_bos must be one embedding row \[1, 8\]"):
        new_stream().step(layers(0, 2), tts_bos=torch.ones(2, H))


def test_chunk_id_must_match_payloads_built() -> None:
    processor = ThinkerToTalkerProcessor(accept_hidden_layer=ACCEPT)
    state = processor.new_state(PROMPT)
    with pytest.raises(PayloadEncodeError, match="chunk_id 1 does not match the 0 payload"):
        processor.step(state, layers(0, 1), chunk_id=1, finished=False, token_ids=PROMPT)


def test_token_ids_may_be_tensors_and_are_validated() -> None:
    processor = ThinkerToTalkerProcessor(accept_hidden_layer=ACCEPT)
    state = processor.new_state(torch.tensor(PROMPT))
    assert state.prompt_ids == PROMPT
    out = processor.step(
        state, layers(0, 6), chunk_id=0, finished=False, token_ids=torch.tensor([*PROMPT, 4])
    )
    assert out is not None and out.ids["all"] == [*PROMPT, 4]
    with pytest.raises(PayloadEncodeError, match="prompt_ids must be a 1-D integer tensor"):
        processor.new_state(torch.ones(3))
    with pytest.raises(PayloadEncodeError, match="prompt_ids must contain ints"):
        processor.new_state([1, "2"])  # type: ignore[list-item]


@pytest.mark.parametrize("layer", [-1, True, "24"])
def test_accept_hidden_layer_is_validated(layer: Any) -> None:
    with pytest.raises(ConfigError, match="accept_hidden_layer"):
        ThinkerToTalkerProcessor(accept_hidden_layer=layer)


def _stage_payload(context: Any) -> Any:
    """Chunk 0 of ``ThinkerToTalkerStage`` for one finishing step with ``context``."""
    from types import SimpleNamespace

    from omnirelay.processors.streams import ThinkerToTalkerStage

    stage = ThinkerToTalkerStage(SimpleNamespace(id=0), None)  # type: ignore[arg-type]
    out = {"hidden_layers": layers(0, len(PROMPT) + 1), "token_ids": [*PROMPT, 7], **tts()}
    req = SimpleNamespace(output=out, external_id="r1", context=context, is_finished=True, chunk_id=0)
    try:
        return stage.build(req)  # type: ignore[arg-type]
    finally:
        stage.release("r1", ReleaseScope.REQUEST)


@pytest.mark.parametrize(
    ("extras", "speaker"),
    [({"voice": "Chelsie"}, "chelsie"), ({"voice": " "}, None), ({}, None), (None, None)],
)
def test_stage_passes_the_request_voice_as_speaker(extras: Any, speaker: str | None) -> None:
    from types import SimpleNamespace

    from omnirelay.processors.streams import request_voice

    context = SimpleNamespace(prompt_token_ids=tuple(PROMPT), extras=extras)
    assert request_voice(context) == speaker
    payload = _stage_payload(context)
    assert payload.speaker == speaker


def test_stage_without_extras_in_the_snapshot_uses_the_default_speaker() -> None:
    from types import SimpleNamespace

    payload = _stage_payload(SimpleNamespace(prompt_token_ids=tuple(PROMPT)))
    assert payload.speaker is None
