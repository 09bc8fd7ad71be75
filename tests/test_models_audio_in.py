"""The audio input contract and Qwen3-Omni's audio encoder geometry: the prompt reserves
exactly as many audio positions as the encoder makes, for the real configuration's window
and mel bins (its width shrunk: the count depends on the geometry only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs, read_audio_inputs
from omnirelay.models.qwen3_omni.audio import QwenAudioEncoder, num_audio_tokens

FULL_SIZE = (
    Path(__file__).resolve().parents[1]
    / "omnirelay"
    / "models"
    / "qwen3_omni"
    / "configs"
    / "qwen3-omni-30b-a3b.json"
)


@pytest.fixture(scope="module")
def real_geometry() -> QwenAudioEncoder:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    raw = json.loads(FULL_SIZE.read_text())["thinker_config"]["audio_config"]
    small = {"encoder_layers": 1, "d_model": 32, "encoder_attention_heads": 2, "encoder_ffn_dim": 32}
    small.update(downsample_hidden_size=8, output_dim=16)
    keep = ("num_mel_bins", "n_window", "n_window_infer", "conv_chunksize", "max_source_positions")
    config = Qwen3OmniMoeAudioEncoderConfig(**{k: raw[k] for k in keep}, **small)
    assert (config.num_mel_bins, config.n_window, config.n_window_infer) == (128, 50, 800)
    torch.manual_seed(0)
    return QwenAudioEncoder(Qwen3OmniMoeAudioEncoder(config).eval())


@pytest.mark.parametrize("seconds", [0.01, 0.995, 1.0, 1.005, 7.77, 8.0, 8.3])
def test_the_prompt_reserves_what_the_real_encoder_makes(
    real_geometry: QwenAudioEncoder, seconds: float
) -> None:
    clip = torch.from_numpy(
        np.random.default_rng(1).normal(0, 0.1, int(seconds * AUDIO_INPUT_RATE)).astype(np.float32)
    )
    with torch.inference_mode():
        rows = real_geometry.embed([clip])
    assert rows.shape == (num_audio_tokens(clip.numel(), 50), 16)


def test_thirteen_tokens_a_second() -> None:
    assert [num_audio_tokens(AUDIO_INPUT_RATE * s, 50) for s in (1, 2, 10)] == [13, 26, 130]


def test_the_input_contract_is_checked() -> None:
    inputs = audio_inputs([np.zeros(10, dtype=np.float32), np.ones(3, dtype=np.float32)])
    assert [c.numel() for c in read_audio_inputs(inputs, "r")] == [10, 3]
    assert read_audio_inputs(None, "r") == [] and read_audio_inputs({"text": "x"}, "r") == []
    with pytest.raises(ModelError, match="at 8000 Hz; the contract is 16000 Hz"):
        read_audio_inputs({**inputs, "sample_rate": 8000}, "r")
    with pytest.raises(ModelError, match="clip 0 must be a non-empty 1-D float waveform"):
        read_audio_inputs({"audio": [torch.zeros(2, 2)], "sample_rate": AUDIO_INPUT_RATE}, "r")
    with pytest.raises(ModelError, match="must be a list of waveforms"):
        read_audio_inputs({"audio": torch.zeros(3), "sample_rate": AUDIO_INPUT_RATE}, "r")
