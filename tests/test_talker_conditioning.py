"""The Talker's conditioning built for a whole step at once: each request's rows are what
its own layout says (user text / multimodal rows, the 9-row assistant bootstrap with its
codec rows, queued text rows), whatever else is in the step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.models.talker_conditioning import build_conditionings
from omnirelay.models.talker_input import ThinkerChunk

IM_START, USER, ASSISTANT, AUDIO, NL = 1, 2, 3, 9, 7
H_IN, H = 6, 5
SPEC = SimpleNamespace(
    im_start_token_id=IM_START,
    assistant_token_id=ASSISTANT,
    user_token_id=USER,
    multimodal_token_ids=frozenset({AUDIO}),
    codec_nothink_id=10,
    codec_think_bos_id=11,
    codec_think_eos_id=12,
    codec_pad_id=13,
    codec_bos_id=14,
    speaker_ids={"ethan": 20, "chelsie": 21},
)


class FakeTalker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text_projection = torch.nn.Linear(H_IN, H)
        self.hidden_projection = torch.nn.Linear(H_IN, H)
        self.codec = torch.nn.Embedding(32, H)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.codec


def chunk(prompt: list[int], *, decode: int = 0, speaker: str | None = None) -> ThinkerChunk:
    n = len(prompt)
    return ThinkerChunk(
        is_finished=False,
        prefill_embed=torch.randn(n, H_IN),
        prefill_hidden=torch.randn(n, H_IN),
        prompt_ids=tuple(prompt),
        tts_bos=torch.randn(1, H_IN),
        tts_eos=torch.randn(1, H_IN),
        tts_pad=torch.randn(1, H_IN),
        speaker=speaker,
        decode_embed=torch.randn(decode, H_IN) if decode else None,
    )


def expected(model: FakeTalker, c: ThinkerChunk) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    """The layout, row by row: (embeds, queued text rows, only EOS to speak)."""
    assert c.prefill_embed is not None and c.prefill_hidden is not None
    text, hidden = model.text_projection, model.hidden_projection
    prompt = list(c.prompt_ids)
    start = max(i for i in range(len(prompt) - 1) if prompt[i : i + 2] == [IM_START, ASSISTANT])
    rows = []
    turn = 0
    for p, token in enumerate(prompt[:start]):
        turn = p if token == IM_START else turn
        if prompt[turn + 1] == USER:
            rows.append(hidden(c.prefill_hidden[p]) if token == AUDIO else text(c.prefill_embed[p]))
    assistant = text(c.prefill_embed[start:])
    pad, bos, eos = text(c.tts_pad[0]), text(c.tts_bos[0]), text(c.tts_eos[0])
    header = [assistant[k] if k < len(assistant) else pad for k in range(3)]
    first = assistant[3] if len(assistant) > 3 else eos
    speaker = SPEC.speaker_ids[(c.speaker or "ethan").lower()]
    codec = model.codec(torch.tensor([10, 11, 12, speaker, 13, 14]))
    boot = torch.stack([*header, pad, pad, pad, pad, bos, first])
    boot[3:] += codec
    queued = list(assistant[4:])
    if c.decode_embed is not None:
        queued += list(text(c.decode_embed))
    return torch.cat([torch.stack(rows), boot]) if rows else boot, queued, len(assistant) <= 3


CASES = {
    "text": [IM_START, USER, 4, 5, NL, IM_START, ASSISTANT, NL, 30, 31, 32],
    "audio": [IM_START, USER, AUDIO, AUDIO, 4, NL, IM_START, ASSISTANT, NL, 30],
    "system+user": [
        IM_START,
        8,
        4,
        NL,
        IM_START,
        USER,
        AUDIO,
        5,
        NL,
        IM_START,
        ASSISTANT,
        NL,
        30,
        31,
        32,
        33,
        34,
    ],
    "header only": [IM_START, USER, 4, NL, IM_START, ASSISTANT],
}


@torch.inference_mode()
def test_each_request_gets_its_own_layout_in_a_shared_step() -> None:
    model = FakeTalker()
    chunks = [
        (name, chunk(p, decode=k % 3, speaker="Chelsie" if k == 1 else None))
        for k, (name, p) in enumerate(CASES.items())
    ]
    together = build_conditionings(model, SPEC, chunks, torch.device("cpu"), torch.float32)
    for (name, c), got in zip(chunks, together):
        embeds, queued, only_eos = expected(model, c)
        alone = build_conditionings(model, SPEC, [(name, c)], torch.device("cpu"), torch.float32)[0]
        for cond in (got, alone):
            torch.testing.assert_close(cond.embeds, embeds, msg=name)
            assert len(cond.text_rows) == len(queued), name
            for row, want in zip(cond.text_rows, queued):
                assert row.shape == (1, H)
                torch.testing.assert_close(row[0], want, msg=name)
            assert cond.is_eos_fed is only_eos, name
            assert c.tts_eos is not None and c.tts_pad is not None
            torch.testing.assert_close(cond.tts_eos[0], model.text_projection(c.tts_eos[0]))
            torch.testing.assert_close(cond.tts_pad[0], model.text_projection(c.tts_pad[0]))


@pytest.mark.parametrize(
    ("prompt", "speaker", "words"),
    [
        ([IM_START, USER, 4, NL], None, "no '<|im_start|>assistant' turn"),
        ([IM_START, USER, 4, NL, IM_START, ASSISTANT, NL], "nobody", "unknown speaker 'nobody'"),
    ],
)
def test_a_bad_request_names_itself(prompt: list[int], speaker: str | None, words: str) -> None:
    good = ("good", chunk(CASES["text"]))
    with pytest.raises(ModelError, match="'bad'") as info:
        build_conditionings(
            FakeTalker(),
            SPEC,
            [good, ("bad", chunk(prompt, speaker=speaker))],
            torch.device("cpu"),
            torch.float32,
        )
    assert words in str(info.value)
