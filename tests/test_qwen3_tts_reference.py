"""omnirelay's Qwen3-TTS equals the reference ``qwen-tts`` forward on a tiny config.

The fixtures (``tests/fixtures/qwen3_tts/``) were made once by ``make_fixtures.py`` with
``qwen-tts`` 0.1.1 on ``transformers`` 4.57.3 in an environment of its own (the provenance
is in ``reference.json``). Both sides draw the same weights by parameter name
(``omnirelay.models.qwen3_tts.seeded``), so these tests also pin the checkpoint's names
and shapes. What is compared, in float32 on the CPU:

* the Talker's prefill, built from the prompt ids, speaker, language and instruction as
  the reference lays it out (both text modes): the first codebook's logits and the
  hidden state, within 1e-5;
* the code predictor's logits of three codebooks, teacher-forced on the reference's
  first frame, within 1e-5;
* the 12 Hz decoder's waveform of 40 frames and its chunked decode (16 frames with 6 of
  context, docs/protocol.md §6.3), within 1e-6.

The greedy generation of whole utterances through the executor is compared in
``tests/test_qwen3_tts_talker.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from omnirelay.models.qwen3_tts.codec import TTSCodec
from omnirelay.models.qwen3_tts.conditioning import Voice, build_conditioning
from omnirelay.models.qwen3_tts.model_config import CodecConfig, TTSConfig
from omnirelay.models.qwen3_tts.seeded import RECIPE_VERSION, fill_seeded
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from omnirelay.processors.decode_window import chunked_decode

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tts"
META: dict[str, Any] = json.loads((FIXTURES / "reference.json").read_text())
CASES = {c["name"]: c for c in META["talker_cases"]}


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "reference.safetensors"))


@pytest.fixture(scope="module")
def talker() -> tuple[TTSTalker, TTSConfig]:
    config = TTSConfig.from_dict(META["tts_config"])
    model = TTSTalker(config.talker_config).eval()
    fill_seeded(model.state_dict(keep_vars=True), META["provenance"]["seed"], prefix="talker.")
    return model, config


@pytest.fixture(scope="module")
def codec() -> TTSCodec:
    model = TTSCodec(CodecConfig.from_dict(META["decoder_config"])).eval()
    fill_seeded(model.state_dict(keep_vars=True), META["provenance"]["seed"], prefix="decoder.")
    return model


def voice_of(case: dict[str, Any]) -> Voice:
    ids = case["instruct_ids"]
    return Voice(speaker=case["speaker"], language=case["language"], instruct_ids=tuple(ids) if ids else None)


def test_fixtures_were_made_with_this_weight_recipe() -> None:
    provenance = META["provenance"]
    assert provenance["seeded_recipe"] == RECIPE_VERSION
    assert provenance["qwen_tts"] == "0.1.1" and provenance["transformers"] == "4.57.3"


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_logits_equal_the_reference(
    name: str, talker: tuple[TTSTalker, TTSConfig], tensors: dict[str, torch.Tensor]
) -> None:
    model, config = talker
    case = CASES[name]
    with torch.inference_mode():
        cond = build_conditioning(
            model, config, case["input_ids"], voice_of(case), text_streaming=not case["non_streaming_mode"]
        )
        logits, hidden = model.prefill_logits(cond.prefill.unsqueeze(0))
    assert cond.prefill.shape[0] == case["prefill_length"]
    torch.testing.assert_close(logits[0, -1], tensors[f"{name}.prefill_logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[0, -1], tensors[f"{name}.prefill_hidden"], atol=1e-5, rtol=1e-5)
    # Greedy: the reference's first frame starts with this logits' best code.
    assert int(logits[0, -1, : config.talker_config.codebook_size].argmax()) == case["codes"][0][0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_code_predictor_logits_equal_the_reference(
    name: str, talker: tuple[TTSTalker, TTSConfig], tensors: dict[str, torch.Tensor]
) -> None:
    model, config = talker
    case = CASES[name]
    codes = torch.tensor(case["codes"][:1])
    with torch.inference_mode():
        cond = build_conditioning(
            model, config, case["input_ids"], voice_of(case), text_streaming=not case["non_streaming_mode"]
        )
        _, hidden = model.prefill_logits(cond.prefill.unsqueeze(0))
        logits = model.predictor_logits(hidden[:, -1], codes)
    for g in case["predictor_groups"]:
        torch.testing.assert_close(
            logits[0, g], tensors[f"{name}.predictor_logits_{g}"], atol=1e-5, rtol=1e-5
        )
    assert logits[0].argmax(-1).tolist() == case["codes"][0][1:]


def test_decoder_waveform_equals_the_reference(codec: TTSCodec, tensors: dict[str, torch.Tensor]) -> None:
    codes = torch.tensor(META["decoder"]["codes"]).unsqueeze(0)
    with torch.inference_mode():
        wav = codec(codes)
    assert wav.shape == (1, 1, codes.shape[-1] * codec.total_upsample)  # nothing held back
    torch.testing.assert_close(wav[0, 0], tensors["decoder.wav"], atol=1e-6, rtol=1e-5)


def test_chunked_decode_equals_the_reference(codec: TTSCodec, tensors: dict[str, torch.Tensor]) -> None:
    spec = META["decoder"]
    codes = torch.tensor(spec["codes"]).unsqueeze(0)
    with torch.inference_mode():
        wav = chunked_decode(
            codec,
            codes,
            upsample=codec.total_upsample,
            chunk_size=spec["chunk_size"],
            left_context=spec["left_context_size"],
        )
    torch.testing.assert_close(wav[0, 0], tensors["decoder.chunked_wav"], atol=1e-6, rtol=1e-5)
