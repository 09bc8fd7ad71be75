"""A tiny Qwen3-Omni built from configs with seeded random weights: no hub, no download.

* :func:`build_tiny` ``(model_dir=None, seed=0) -> Path`` — writes a complete checkpoint
  directory (``config.json``, ``model.safetensors``, tokenizer files) with
  ``save_pretrained``, exactly the layout of a real Qwen3-Omni checkpoint, so the tiny
  path and ``--model PATH`` go through the same loader. Made on first use and cached
  under :func:`default_cache_dir` (``$OMNIRELAY_CACHE`` or ``~/.cache/omnirelay``).
* :func:`cached_tiny_dir` — the cache path :func:`build_tiny` uses for a seed (built or not).
* :func:`tiny_config` — the composite config (Thinker, Talker with its code predictor,
  Code2Wav, and the token ids of the tiny tokenizer).
* :func:`build_tiny_tokenizer` — a byte-level BPE trained on a small built-in text, with
  the Qwen chat and TTS special tokens; ids → text and text → ids work offline.

What is tiny and what is not: every transformer is 1–2 layers of width 64 (MoE with 4
experts, top-2), but the codec layout is the real one — 16 codebooks of 2048 codes, codec
EOS 2150 and the real codec special ids, 1920 samples per frame at 24 kHz (80 ms) — so
processors, stop ids and frame schedules see the numbers of the real model. The Code2Wav
decoder uses upsample stages (8·8 then 5·3·2) and a 2-frame attention window, so its
receptive field is a few frames: left context of 4 frames already decodes exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from omnirelay.errors import ModelError
from omnirelay.models.hf import quiet_transformers

__all__ = [
    "CACHE_ENV",
    "TINY_IMAGE_PIXELS",
    "TINY_RECIPE_VERSION",
    "TINY_SPECIAL_TOKENS",
    "build_tiny",
    "build_tiny_tokenizer",
    "cached_tiny_dir",
    "default_cache_dir",
    "make_tiny_model",
    "scale_audio_tower",
    "scale_code2wav",
    "scale_vision_tower",
    "tiny_config",
]

#: Environment variable naming the cache directory of built tiny models.
CACHE_ENV = "OMNIRELAY_CACHE"
#: Bump when anything below changes what a tiny checkpoint contains.
TINY_RECIPE_VERSION = 3

#: Special tokens of the tiny tokenizer (the names of the real Qwen3-Omni tokenizer).
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "<|tts_pad|>",
)
#: Role words that must be single tokens (the Talker finds turns by the role token).
_ROLE_TOKENS = ("system", "user", "assistant")

_TRAINING_TEXT = (
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "The quick brown fox jumps over the lazy dog. A tiny model speaks in a tiny voice.",
    "Tell me a story about the sea, the wind and the stars. Once upon a time there was a ship.",
    "Numbers: one two three four five six seven eight nine ten. 0 1 2 3 4 5 6 7 8 9.",
    "Please answer briefly. Yes, no, maybe. Thanks, goodbye, see you soon!",
)
_BPE_VOCAB_SIZE = 384  # 256 byte symbols + merges

_CODEC: dict[str, Any] = {
    "codebook_size": 2048,
    "num_code_groups": 16,
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
    "talker_vocab_size": 3072,
    "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
}
#: Standard deviation of the tiny decoder's output (before the final clamp to ±1).
_TINY_AUDIO_STD = 0.1
#: Gain of the tiny audio encoder's last projection (its tokens near the text embeddings' scale).
_TINY_AUDIO_TOKEN_SCALE = 0.05
#: Gain of the tiny vision tower's last projections (its tokens near the text embeddings' scale).
_TINY_IMAGE_TOKEN_SCALE = 0.05
#: The tiny image processor's pixel range (``preprocessor_config.json``): one image token is
#: 8 × 8 pixels (patch 4, merge 2), so an image takes 4 to 64 tokens.
TINY_IMAGE_PIXELS = (16 * 16, 64 * 64)
#: Weight scale of the vocoder's residual-unit convs relative to variance-preserving.
_RESIDUAL_GAIN = 0.3


def default_cache_dir() -> Path:
    """``$OMNIRELAY_CACHE``, else ``~/.cache/omnirelay``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "omnirelay"


# --------------------------------------------------------------------------- tokenizer


def build_tiny_tokenizer() -> Any:
    """A byte-level BPE (``PreTrainedTokenizerFast``) trained on a built-in text.

    Deterministic: the same merges and ids on every machine. Any text encodes (bytes are
    the base alphabet); the chat/TTS specials and the role words are single tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(list(_TRAINING_TEXT), trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in TINY_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(w, normalized=False) for w in _ROLE_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )


# --------------------------------------------------------------------------- config


def _rope() -> dict[str, Any]:
    # head_dim 16 → 8 rotary frequencies, split over (temporal, height, width) like the
    # real [24, 20, 20] split of 64.
    return {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [4, 2, 2],
        "interleaved": True,
    }


def tiny_config(token_ids: dict[str, int], vocab_size: int) -> Any:
    """The composite ``Qwen3OmniMoeConfig`` of the tiny model.

    ``token_ids`` maps the special token names (without ``<|…|>``) and role words of the
    tokenizer to their ids; ``vocab_size`` is the tokenizer's size (the Thinker's vocab).
    """
    from transformers import Qwen3OmniMoeConfig

    t = token_ids
    width = 64
    text = {
        "vocab_size": vocab_size,
        "hidden_size": width,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": _rope(),
        "eos_token_id": t["im_end"],
        "pad_token_id": t["endoftext"],
    }
    audio = {
        "num_mel_bins": 16,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": width,
        "downsample_hidden_size": 16,
        "max_source_positions": 64,
        # The real window (100 feature frames, 1 s, per chunk of 13 tokens): the library's
        # token count assumes it, whatever the config says.
        "n_window": 50,
        "n_window_infer": 200,
        "conv_chunksize": 16,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": width,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    }
    thinker = {
        "text_config": text,
        "audio_config": audio,
        "vision_config": vision,
        "audio_token_id": t["audio_pad"],
        "image_token_id": t["image_pad"],
        "video_token_id": t["video_pad"],
        "audio_start_token_id": t["audio_start"],
        "user_token_id": t["user"],
        # Not declared by the config class, but read by the position-id code (as in the
        # real checkpoint's config.json).
        "vision_start_token_id": t["vision_start"],
    }
    talker_text = {
        "vocab_size": _CODEC["talker_vocab_size"],
        "hidden_size": width,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        # Not a declared field of the config class, but the MoE block reads it.
        "shared_expert_intermediate_size": 64,
        "max_position_embeddings": 4096,
        "rope_parameters": _rope(),
    }
    code_predictor = {
        "vocab_size": _CODEC["codebook_size"],
        "hidden_size": width,  # the predictor reads the Talker's hidden state directly
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_code_groups": _CODEC["num_code_groups"],
        "max_position_embeddings": 64,
    }
    talker = {
        "text_config": talker_text,
        "code_predictor_config": code_predictor,
        "num_code_groups": _CODEC["num_code_groups"],
        "thinker_hidden_size": width,
        "accept_hidden_layer": 1,
        "codec_eos_token_id": _CODEC["codec_eos_token_id"],
        "codec_pad_id": _CODEC["codec_pad_id"],
        "codec_bos_id": _CODEC["codec_bos_id"],
        "codec_nothink_id": _CODEC["codec_nothink_id"],
        "codec_think_bos_id": _CODEC["codec_think_bos_id"],
        "codec_think_eos_id": _CODEC["codec_think_eos_id"],
        "speaker_id": dict(_CODEC["speaker_id"]),
        "audio_token_id": t["audio_pad"],
        "image_token_id": t["image_pad"],
        "video_token_id": t["video_pad"],
        "vision_start_token_id": t["vision_start"],
        "audio_start_token_id": t["audio_start"],
        # Read by the Talker's constructor; the default config does not define it.
        "spatial_merge_size": 2,
    }
    code2wav = {
        "codebook_size": _CODEC["codebook_size"],
        "num_quantizers": _CODEC["num_code_groups"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": 2,
        "max_position_embeddings": 8000,
        # 8·8 · 5·3·2 = 1920 samples per frame, as the real 2·2 · 8·5·4·3.
        "upsampling_ratios": [8, 8],
        "upsample_rates": [5, 3, 2],
        "decoder_dim": 16,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=t["im_start"],
        im_end_token_id=t["im_end"],
        tts_pad_token_id=t["tts_pad"],
        tts_bos_token_id=t["tts_bos"],
        tts_eos_token_id=t["tts_eos"],
        system_token_id=t["system"],
        user_token_id=t["user"],
        assistant_token_id=t["assistant"],
    )


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids: dict[str, int] = {}
    for name in (*TINY_SPECIAL_TOKENS, *_ROLE_TOKENS):
        token_id = tokenizer.convert_tokens_to_ids(name)
        if not isinstance(token_id, int) or token_id < 0:
            raise ModelError(f"tiny tokenizer lacks the token {name!r}")  # a recipe bug
        ids[name.removeprefix("<|").removesuffix("|>")] = token_id
    return ids


# --------------------------------------------------------------------------- weights


def scale_code2wav(code2wav: Any) -> None:
    """Give the random vocoder an audible, unclamped output.

    With the default init (std 0.02) every conv shrinks the signal and the waveform is
    ~1e-7: any error test would pass trivially. Variance-preserving convs (residual
    branches damped) and unit-scale code embeddings keep it alive; the final (linear) conv
    is scaled so the output has a standard deviation of about 0.1 on random codes.
    """
    with torch.no_grad():
        residual = {
            id(conv)
            for unit in code2wav.modules()
            if type(unit).__name__.endswith("ResidualUnit")
            for conv in unit.modules()
            if isinstance(conv, torch.nn.Conv1d)
        }
        convs = [m for m in code2wav.modules() if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d)]
        for conv in convs:
            w = conv.weight
            if isinstance(conv, torch.nn.ConvTranspose1d):
                fan_in = w.shape[0] * w.shape[2] // conv.stride[0]
            else:
                fan_in = w.shape[1] * w.shape[2]
            # Residual branches at full gain make the 22 stacked snake units chaotic: float
            # rounding (1e-9) would grow to 1e-5 at the output. A damped branch keeps the
            # decoder well conditioned, as a trained vocoder is.
            gain = _RESIDUAL_GAIN if id(conv) in residual else 1.0
            w.normal_(0.0, gain / math.sqrt(fan_in))
            if conv.bias is not None:
                conv.bias.zero_()
        code2wav.code_embedding.weight.normal_(0.0, 1.0)
        config = code2wav.config
        codes = torch.randint(0, config.codebook_size, (1, config.num_quantizers, 40))
        codes = codes.to(code2wav.code_embedding.weight.device)
        final = convs[-1]
        final.weight.mul_(0.1)  # well inside the clamp while measuring
        std = float(code2wav(codes).std())
        if std > 0:
            final.weight.mul_(_TINY_AUDIO_STD / std)


def scale_audio_tower(tower: Any) -> None:
    """Make the random audio encoder hear its input.

    With the default init (std 0.02) three stacked convolutions shrink the features to
    nothing and the sinusoidal positions alone decide the output: every clip would give the
    same audio tokens, and a test could not tell whether the audio reached the Thinker.
    Variance-preserving convolutions and projections keep the features alive; the last
    projection brings the output to about the scale of the text embeddings.
    """
    with torch.no_grad():
        layers = [m for m in tower.modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)]
        for layer in layers:
            w = layer.weight
            fan_in = w[0].numel()
            w.normal_(0.0, 1.0 / math.sqrt(fan_in))
            if layer.bias is not None:
                layer.bias.zero_()
        tower.proj2.weight.mul_(_TINY_AUDIO_TOKEN_SCALE)


def scale_vision_tower(visual: Any) -> None:
    """Make the random vision encoder see its input.

    Variance-preserving patch embedding and projections keep the pixels' differences alive
    through the blocks (the default init, std 0.02, leaves the learned position table the
    larger part of each patch); the last projection of the merger and of each deepstack
    merger brings the output to about the scale of the text embeddings, so different images
    give clearly different tokens and a test can tell that the image reached the Thinker.
    """
    with torch.no_grad():
        for layer in visual.modules():
            if isinstance(layer, torch.nn.Conv3d | torch.nn.Linear):
                w = layer.weight
                w.normal_(0.0, 1.0 / math.sqrt(w[0].numel()))
                if layer.bias is not None:
                    layer.bias.zero_()
        for merger in (visual.merger, *visual.merger_list):
            merger.mlp[-1].weight.mul_(_TINY_IMAGE_TOKEN_SCALE)


def _init_experts(model: torch.nn.Module, std: float) -> None:
    """Initialize every MoE experts block from the seeded RNG.

    The library's ``_init_weights`` misses the Talker's experts: they would keep whatever
    ``torch.empty`` left in memory — a different (often denormal) model on every build.
    """
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Experts"):
                for param in module.parameters(recurse=False):
                    param.normal_(0.0, std)


def _readable_thinker_head(thinker: Any, tokenizer: Any) -> None:
    """Make the random Thinker write printable ASCII rather than broken UTF-8 bytes.

    The output rows of special tokens and of tokens that do not decode to printable ASCII
    are zeroed: their logit is exactly 0 while some printable token's logit is positive,
    so greedy decoding never picks them (sampling rarely). Only the tiny model does this;
    it makes demos readable and keeps random byte soup out of the text stream.
    """
    special = set(tokenizer.all_special_ids)
    head = thinker.lm_head.weight
    with torch.no_grad():
        for token_id in range(head.shape[0]):
            text = tokenizer.decode([token_id]) if token_id < len(tokenizer) else ""
            if token_id in special or not text or not all(" " <= ch <= "~" for ch in text):
                head[token_id].zero_()


# --------------------------------------------------------------------------- build


def _recipe_key(seed: int) -> str:
    import tokenizers
    import transformers

    recipe = {
        "version": TINY_RECIPE_VERSION,
        "seed": seed,
        # the audio tower's recipe (the real window, scaled weights: scale_audio_tower)
        "audio_tower": 1,
        # the vision tower's recipe (scaled weights: scale_vision_tower; the processor file)
        "vision_tower": 1,
        # The saved layout follows the library's conversions; rebuild when they change.
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__.split("+")[0],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def make_tiny_model(seed: int = 0) -> tuple[Any, Any]:
    """The tiny ``Qwen3OmniMoeForConditionalGeneration`` (eval mode) and its tokenizer, in
    memory. :func:`build_tiny` saves exactly this; tests compare the two."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tokenizer = build_tiny_tokenizer()
    # A private RNG stream: building must not disturb (or depend on) the caller's RNG.
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        config = tiny_config(_token_ids(tokenizer), vocab_size=len(tokenizer))
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
        _init_experts(model, std=float(config.initializer_range))
        scale_code2wav(model.code2wav)
        _readable_thinker_head(model.thinker, tokenizer)
        thinker = model.thinker
        scale_audio_tower(getattr(thinker.model, "audio_tower", None) or thinker.audio_tower)
        scale_vision_tower(getattr(thinker.model, "visual", None) or thinker.visual)
    return model, tokenizer


def _write_tiny(target: Path, seed: int) -> None:
    model, tokenizer = make_tiny_model(seed)
    with quiet_transformers():
        model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    # The image processor's numbers, as a real checkpoint ships them (the vision tower's
    # patch sizes are in config.json; the pixel range and normalization are here).
    vision = model.config.thinker_config.vision_config
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "min_pixels": TINY_IMAGE_PIXELS[0],
        "max_pixels": TINY_IMAGE_PIXELS[1],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (target / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    (target / "omnirelay_tiny.json").write_text(
        json.dumps({"recipe_version": TINY_RECIPE_VERSION, "seed": seed}, indent=2) + "\n"
    )


def cached_tiny_dir(seed: int = 0) -> Path:
    """Where :func:`build_tiny` caches the tiny model of ``seed`` (it may not exist yet:
    ``(path / "config.json").is_file()`` says whether it was built)."""
    return default_cache_dir() / f"tiny-qwen3-omni-{_recipe_key(seed)}"


def build_tiny(model_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """The directory of the tiny checkpoint for ``seed``, built on first use.

    ``model_dir=None`` caches it under :func:`default_cache_dir` as
    ``tiny-qwen3-omni-<hash>`` (the hash covers the recipe, the seed and the library
    versions); an explicit ``model_dir`` is (re)used as is when it already holds a
    checkpoint. The directory appears atomically (built aside, then renamed), so stage
    processes that start together never see a half-written one.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelError(f"tiny model seed must be an int >= 0, got {seed!r}")
    if model_dir is None:
        target = cached_tiny_dir(seed)
    else:
        target = Path(model_dir).expanduser()
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        raise ModelError(f"cannot create the tiny model directory next to {target}: {exc}") from exc
    try:
        _write_tiny(tmp, seed)
        try:
            if target.exists() and not any(target.iterdir()):
                target.rmdir()  # an empty directory given by the caller
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process won the race; its checkpoint is identical.
    except OSError as exc:
        raise ModelError(f"cannot write the tiny model to {target}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
