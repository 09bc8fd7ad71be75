"""Qwen3-TTS models from a local checkpoint directory (the released layout), from the
shipped configs of the released sizes, and the tiny one; a checkpoint that does not fit
its configuration is refused by tensor name, never loaded as a silently random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.qwen3_tts.codec import TTSCodec
from omnirelay.models.qwen3_tts.loader import SHIPPED_MODELS, TTSCheckpoint, TTSModelArgs, check_checkpoint
from omnirelay.models.qwen3_tts.model_config import CodecConfig, TTSConfig
from omnirelay.models.qwen3_tts.talker_model import TTSTalker
from omnirelay.models.qwen3_tts.tiny import tiny_codec_config, tiny_tts_config


def write_checkpoint(target: Path, *, drop: str | None = None, reshape: str | None = None) -> Path:
    """The tiny model as a released checkpoint directory (weights of seed 5)."""
    tiny = TTSCheckpoint.open(TTSModelArgs(tiny=True, seed=5))
    talker, codec = tiny.load_talker(), tiny.load_codec()
    weights = {f"talker.{k}": v.contiguous() for k, v in talker.state_dict().items()}
    weights["speaker_encoder.fc.weight"] = torch.zeros(2, 2)  # a Base model's part: not read
    decoder = {f"decoder.{k}": v.contiguous() for k, v in codec.state_dict().items()}
    decoder["encoder.conv.weight"] = torch.zeros(2)  # the tokenizer's encoder: not read
    if drop is not None:
        weights.pop(drop)
    if reshape is not None:
        weights[reshape] = torch.zeros(3, 3)
    (target / "speech_tokenizer").mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(tiny_tts_config()))
    (target / "speech_tokenizer" / "config.json").write_text(json.dumps(tiny_codec_config()))
    (target / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.1, "subtalker_top_k": 20})
    )
    save_file(weights, str(target / "model.safetensors"))
    save_file(decoder, str(target / "speech_tokenizer" / "model.safetensors"))
    return target


def test_a_checkpoint_directory_loads_its_weights_by_name(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt")
    check_checkpoint(str(path), "auto")
    ckpt = TTSCheckpoint.open(TTSModelArgs(model_dir=str(path)))
    seeded = TTSCheckpoint.open(TTSModelArgs(tiny=True, seed=5))
    for a, b in zip(ckpt.load_talker().state_dict().values(), seeded.load_talker().state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(ckpt.load_codec().state_dict().values(), seeded.load_codec().state_dict().values()):
        assert torch.equal(a, b)
    assert ckpt.generation.repetition_penalty == 1.1 and ckpt.generation.subtalker_top_k == 20
    assert ckpt.generation.min_new_tokens == 2  # the reference's, absent from the file
    tok = ckpt.load_tokenizer()  # no tokenizer files: the byte-level one with the config's ids
    assert tok.convert_tokens_to_ids("<|im_start|>") == ckpt.config.im_start_token_id


@pytest.mark.parametrize(
    ("drop", "reshape", "message"),
    [
        ("talker.codec_head.weight", None, "lacks 1 talker.* tensors, e.g. talker.'codec_head.weight'"),
        (None, "talker.model.norm.weight", r"'talker.model.norm.weight' has shape \(3, 3\)"),
        (None, "talker.model.extra.weight", "unexpected tensor 'talker.model.extra.weight'"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_by_tensor(
    tmp_path: Path, drop: str | None, reshape: str | None, message: str
) -> None:
    path = write_checkpoint(tmp_path / "ckpt", drop=drop, reshape=reshape)
    with pytest.raises(ModelError, match=message):
        TTSCheckpoint.open(TTSModelArgs(model_dir=str(path))).load_talker()


def test_not_a_checkpoint_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        check_checkpoint(str(tmp_path / "nowhere"), "auto")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    with pytest.raises(ModelError, match="not a Qwen3-TTS model"):
        check_checkpoint(str(tmp_path), "auto")


@pytest.mark.parametrize(
    ("name", "billions", "instructed"),
    [("1.7b-customvoice", 1.92, True), ("0.6b-customvoice", 0.91, False), ("1.7b-voicedesign", 1.92, True)],
)
def test_the_shipped_configs_are_the_released_sizes(name: str, billions: float, instructed: bool) -> None:
    ckpt = TTSCheckpoint.open(TTSModelArgs(model=name, load_format="dummy", device="meta"))
    assert ckpt.config.takes_instructions is instructed
    with torch.device("meta"):
        talker = TTSTalker(ckpt.config.talker_config)
        codec = TTSCodec(ckpt.codec_config)
    assert sum(p.numel() for p in talker.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert codec.total_upsample == 1920 and ckpt.codec_config.output_sample_rate == 24000
    assert ckpt.dtype == torch.bfloat16  # the released dtype (float32 only on a CPU)
    assert set(SHIPPED_MODELS) >= {name}


def test_the_configs_check_their_values() -> None:
    config = tiny_tts_config()
    config["talker_config"] = {**config["talker_config"], "codec_eos_token_id": 99999}
    with pytest.raises(ModelError, match="codec_eos_token_id 99999 is not a codec id"):
        TTSConfig.from_dict(config)
    with pytest.raises(ModelError, match="decode_upsample_rate 480"):
        CodecConfig.from_dict({**tiny_codec_config(), "decode_upsample_rate": 480})


def test_executor_args_are_validated_by_name() -> None:
    with pytest.raises(ConfigError, match="unknown Qwen3-TTS executor_args \\['nope'\\]"):
        TTSModelArgs.from_executor_args({"tiny": True, "nope": 1})
    with pytest.raises(ConfigError, match="names no model"):
        TTSModelArgs()
    with pytest.raises(ConfigError, match="runner must be one of auto, static"):
        TTSModelArgs(tiny=True, runner="dynamic")
    assert TTSModelArgs(load_format="tiny").is_tiny
