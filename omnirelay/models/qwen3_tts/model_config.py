"""Qwen3-TTS configuration as typed, validated values (read from a checkpoint's JSON).

A Qwen3-TTS checkpoint directory holds two configs:

* ``config.json`` — the TTS model (:class:`TTSConfig`): the Talker
  (:class:`TalkerConfig`: a Qwen3 decoder over codec and text embeddings, with the codec
  special ids, the speakers and the languages) and its code predictor
  (:class:`PredictorConfig`), the chat and TTS token ids, and the variant
  (``tts_model_type``: ``custom_voice``, ``voice_design`` or ``base``; ``tts_model_size``:
  ``0b6`` or ``1b7``);
* ``speech_tokenizer/config.json`` — the 12 Hz speech tokenizer, of which omnirelay uses
  the decoder (:class:`CodecConfig`: codebooks → 24 kHz waveform).

Each ``from_dict`` reads the keys it knows and ignores the rest (a checkpoint carries many
``transformers`` bookkeeping keys); the defaults are the reference implementation's.
Inconsistent values (heads that do not divide, a codec id outside the vocabulary) are a
:class:`~omnirelay.errors.ModelError` that names the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omnirelay.errors import ModelError

__all__ = [
    "INSTRUCTED_MODEL_TYPES",
    "CodecConfig",
    "PredictorConfig",
    "TTSConfig",
    "TalkerConfig",
]

#: The variants whose Talker reads a natural-language instruction (the 1.7B ones; the
#: 0.6B CustomVoice was trained without, and the reference drops an instruction for it).
INSTRUCTED_MODEL_TYPES = ("custom_voice", "voice_design")

_T = TypeVar("_T")


def _from_dict(cls: type[_T], data: Mapping[str, Any], what: str) -> _T:
    if not isinstance(data, Mapping):
        raise ModelError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in data.items() if k in names}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ModelError(f"{what}: {exc}") from exc


def _positive(what: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(f"{what}.{name} must be a positive integer, got {value!r}")


def _heads(what: str, hidden: int, heads: int, kv_heads: int, head_dim: int | None) -> int:
    _positive(what, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    if heads % kv_heads:
        raise ModelError(
            f"{what}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    dim = head_dim if head_dim is not None else hidden // heads
    _positive(what, head_dim=dim)
    if dim % 2:
        raise ModelError(f"{what}.head_dim must be even (rotary pairs), got {dim}")
    return dim


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """The code predictor: a small Qwen3 decoder that samples codebooks ``1 .. Q−1`` of a
    frame, one per pass, from the Talker's hidden state and the codebooks before."""

    vocab_size: int = 2048
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    num_code_groups: int = 32
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        dim = _heads(
            "code_predictor_config",
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        object.__setattr__(self, "head_dim", dim)
        _positive(
            "code_predictor_config",
            vocab_size=self.vocab_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_code_groups=self.num_code_groups,
        )
        if self.hidden_act != "silu":
            raise ModelError(f"code_predictor_config.hidden_act {self.hidden_act!r} is not supported (silu)")


@dataclass(frozen=True, slots=True)
class TalkerConfig:
    """The Talker: a Qwen3 decoder (multimodal rotary layout; for speech its three
    position rows are always equal, which is plain rotary positions) whose input is the
    sum of codec embeddings and projected text embeddings, and whose head gives the first
    codebook of each frame."""

    vocab_size: int = 3072
    hidden_size: int = 1024
    intermediate_size: int = 2048
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    num_code_groups: int = 32
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    codec_eos_token_id: int = 4198
    codec_think_id: int = 4202
    codec_nothink_id: int = 4203
    codec_think_bos_id: int = 4204
    codec_think_eos_id: int = 4205
    codec_pad_id: int = 4196
    codec_bos_id: int = 4197
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, Any] = field(default_factory=dict)
    codec_language_id: dict[str, int] = field(default_factory=dict)
    code_predictor_config: PredictorConfig = field(default_factory=PredictorConfig)

    def __post_init__(self) -> None:
        dim = _heads(
            "talker_config",
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        object.__setattr__(self, "head_dim", dim)
        if isinstance(self.code_predictor_config, Mapping):
            object.__setattr__(
                self,
                "code_predictor_config",
                _from_dict(PredictorConfig, self.code_predictor_config, "code_predictor_config"),
            )
        _positive(
            "talker_config",
            vocab_size=self.vocab_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_code_groups=self.num_code_groups,
            text_hidden_size=self.text_hidden_size,
            text_vocab_size=self.text_vocab_size,
        )
        if self.hidden_act != "silu":
            raise ModelError(f"talker_config.hidden_act {self.hidden_act!r} is not supported (silu)")
        for name in self.codec_id_names():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ModelError(
                    f"talker_config.{name} {value!r} is not a codec id in [0, {self.vocab_size})"
                )
        for table in ("spk_id", "codec_language_id"):
            for key, value in getattr(self, table).items():
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                    raise ModelError(f"talker_config.{table}[{key!r}] {value!r} is not a codec id")
        for key, dialect in self.spk_is_dialect.items():
            if dialect is not False and dialect not in self.codec_language_id:
                raise ModelError(f"talker_config.spk_is_dialect[{key!r}] names no language: {dialect!r}")
        if self.code_predictor_config.num_code_groups != self.num_code_groups:
            raise ModelError(
                f"code_predictor_config.num_code_groups {self.code_predictor_config.num_code_groups} differs "
                f"from talker_config.num_code_groups {self.num_code_groups}"
            )
        if not self.codebook_size < self.vocab_size:
            raise ModelError(
                f"the codebook ({self.codebook_size} codes) leaves no room for codec special ids in "
                f"talker_config.vocab_size {self.vocab_size}"
            )

    @staticmethod
    def codec_id_names() -> tuple[str, ...]:
        return (
            "codec_eos_token_id",
            "codec_think_id",
            "codec_nothink_id",
            "codec_think_bos_id",
            "codec_think_eos_id",
            "codec_pad_id",
            "codec_bos_id",
        )

    @property
    def codebook_size(self) -> int:
        """Codes per codebook (the code predictor's vocabulary): ids ``[0, codebook_size)``."""
        return self.code_predictor_config.vocab_size

    @property
    def speakers(self) -> tuple[str, ...]:
        """The speakers, lower case, in the config's order."""
        return tuple(str(k).lower() for k in self.spk_id)

    @property
    def languages(self) -> tuple[str, ...]:
        """``auto`` and the languages the Talker can be told (dialects are chosen by speaker)."""
        return ("auto", *(str(k).lower() for k in self.codec_language_id if "dialect" not in str(k)))


@dataclass(frozen=True, slots=True)
class TTSConfig:
    """A Qwen3-TTS checkpoint's ``config.json``."""

    talker_config: TalkerConfig = field(default_factory=TalkerConfig)
    tokenizer_type: str | None = None
    tts_model_size: str | None = None
    tts_model_type: str | None = None
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    assistant_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.talker_config, Mapping):
            object.__setattr__(
                self, "talker_config", _from_dict(TalkerConfig, self.talker_config, "talker_config")
            )
        vocab = self.talker_config.text_vocab_size
        for name in (
            "im_start_token_id",
            "im_end_token_id",
            "tts_pad_token_id",
            "tts_bos_token_id",
            "tts_eos_token_id",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
                raise ModelError(f"config.json {name} {value!r} is not a text id in [0, {vocab})")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TTSConfig:
        if data.get("model_type", "qwen3_tts") != "qwen3_tts":
            raise ModelError(
                f"config.json has model_type {data.get('model_type')!r}, not a Qwen3-TTS model ('qwen3_tts')"
            )
        values = dict(data)
        if "torch_dtype" not in values and "dtype" in values:
            values["torch_dtype"] = values["dtype"]
        return _from_dict(cls, values, "config.json")

    @property
    def takes_instructions(self) -> bool:
        """Whether the Talker reads a speech request's instruction: the 1.7B CustomVoice and
        VoiceDesign models (the reference ignores one given to the 0.6B CustomVoice)."""
        return self.tts_model_type in INSTRUCTED_MODEL_TYPES and self.tts_model_size != "0b6"

    @property
    def needs_speaker(self) -> bool:
        """CustomVoice speaks as one of its speakers; VoiceDesign and Base name none."""
        return self.tts_model_type == "custom_voice"

    @property
    def label(self) -> str:
        size = {"0b6": "0.6B", "1b7": "1.7B"}.get(self.tts_model_size or "", self.tts_model_size or "?")
        kind = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}.get(
            self.tts_model_type or "", self.tts_model_type or "?"
        )
        return f"Qwen3-TTS-12Hz-{size}-{kind}"


@dataclass(frozen=True, slots=True)
class CodecConfig:
    """The 12 Hz speech tokenizer's decoder (``speech_tokenizer/config.json``): 16 codebooks
    per frame, summed into a latent, a sliding-window transformer, then causal
    up-sampling convolutions to 24 kHz (1920 samples per frame)."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 1024
    latent_dim: int = 1024
    head_dim: int | None = None
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8000
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    output_sample_rate: int = 24000

    def __post_init__(self) -> None:
        dim = _heads(
            "decoder_config",
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        object.__setattr__(self, "head_dim", dim)
        object.__setattr__(self, "upsample_rates", tuple(int(r) for r in self.upsample_rates))
        object.__setattr__(self, "upsampling_ratios", tuple(int(r) for r in self.upsampling_ratios))
        _positive(
            "decoder_config",
            codebook_size=self.codebook_size,
            codebook_dim=self.codebook_dim,
            latent_dim=self.latent_dim,
            sliding_window=self.sliding_window,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_quantizers=self.num_quantizers,
            decoder_dim=self.decoder_dim,
        )
        if self.num_quantizers < 2:
            raise ModelError(
                "decoder_config.num_quantizers must be >= 2 (one semantic codebook and the rest)"
            )
        if self.codebook_dim % 2:
            raise ModelError(f"decoder_config.codebook_dim must be even, got {self.codebook_dim}")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ModelError(
                f"decoder_config.decoder_dim {self.decoder_dim} must halve {len(self.upsample_rates)} times"
            )
        if self.hidden_act != "silu":
            raise ModelError(f"decoder_config.hidden_act {self.hidden_act!r} is not supported (silu)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CodecConfig:
        """``speech_tokenizer/config.json`` (its ``decoder_config`` and output rate), or a
        bare decoder config."""
        if data.get("model_type") not in (None, "qwen3_tts_tokenizer_12hz"):
            raise ModelError(
                f"speech_tokenizer/config.json has model_type {data.get('model_type')!r}, not the 12 Hz "
                "tokenizer ('qwen3_tts_tokenizer_12hz')"
            )
        decoder = dict(data.get("decoder_config", data))
        if "output_sample_rate" in data:
            decoder["output_sample_rate"] = data["output_sample_rate"]
        config = _from_dict(cls, decoder, "decoder_config")
        declared = data.get("decode_upsample_rate")
        if declared is not None and int(declared) != config.total_upsample:
            raise ModelError(
                f"speech_tokenizer/config.json decode_upsample_rate {declared} differs from the decoder's "
                f"up-sampling {config.total_upsample}"
            )
        return config

    @property
    def total_upsample(self) -> int:
        """Samples per frame."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)
