"""Loading: the tiny model round-trips through save_pretrained, bad model dirs fail clearly,
executor args are validated, the tokenizer works offline, and the executors register."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import omnirelay.models as models
from omnirelay.errors import ConfigError, ModelError
from omnirelay.models import asr as asr_family
from omnirelay.models import qwen3_omni, qwen3_tts, register_executors
from omnirelay.models import voice as voice_family
from omnirelay.models.asr import ALIGNER_EXECUTOR, RECOGNIZER_EXECUTOR, SPHINX_ALIGNER_EXECUTOR
from omnirelay.models.qwen3_omni import (
    EXECUTOR_NAMES,
    Checkpoint,
    ModelArgs,
    encode_chat_prompt,
    format_chat_prompt,
    load_tokenizer,
)
from omnirelay.models.qwen3_omni.tiny import (
    CACHE_ENV,
    TINY_SPECIAL_TOKENS,
    build_tiny,
    default_cache_dir,
    make_tiny_model,
)
from omnirelay.models.voice import SMOLLM2_EXECUTOR, VOICE_EXECUTOR
from omnirelay.pipeline import ComponentRegistry, load_pipeline
from tests.test_models_support import single_thread, tiny_cache, tiny_dir


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return Checkpoint.open(tiny_dir())


# --------------------------------------------------------------------------- round trip


def test_saved_tiny_model_loads_back_with_identical_weights_and_outputs(checkpoint: Checkpoint) -> None:
    model, _ = make_tiny_model(seed=0)
    parts = {
        "thinker": checkpoint.load_thinker(),
        "talker": checkpoint.load_talker(),
        "code2wav": checkpoint.load_code2wav(),
    }
    reference = model.state_dict()
    for name, part in parts.items():
        state = part.state_dict()
        assert state, name
        for key, value in state.items():
            assert torch.equal(value, reference[f"{name}.{key}"]), f"{name}.{key} differs after loading"

    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        ids = torch.randint(0, 300, (1, 12), generator=gen)
        assert torch.equal(parts["thinker"](input_ids=ids).logits, model.thinker(input_ids=ids).logits)
        embeds = torch.randn(1, 7, 64, generator=gen)
        assert torch.equal(
            parts["talker"].model(inputs_embeds=embeds).last_hidden_state,
            model.talker.model(inputs_embeds=embeds).last_hidden_state,
        )
        codes = torch.randint(0, 2048, (1, 16, 9), generator=gen)
        assert torch.equal(parts["code2wav"](codes), model.code2wav(codes))


def test_sharded_checkpoint_loads_like_a_real_one(tmp_path: Path) -> None:
    """Real checkpoints come in shards with an index; the same loader reads them."""
    model, tokenizer = make_tiny_model(seed=0)
    model.save_pretrained(tmp_path, max_shard_size="4MB")
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    talker = Checkpoint.open(tmp_path, dtype="bfloat16").load_talker()
    assert next(talker.parameters()).dtype == torch.bfloat16
    reference = model.talker.state_dict()
    for key, value in talker.state_dict().items():
        assert torch.equal(value, reference[key].to(torch.bfloat16)), key


def test_tiny_model_is_built_once_and_cached_by_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_dir()
    assert path.parent == tiny_cache() and path.name.startswith("tiny-qwen3-omni-")
    monkeypatch.setenv(CACHE_ENV, str(tiny_cache()))
    assert default_cache_dir() == tiny_cache()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(None, seed=0) == path  # a cache hit: nothing is rewritten
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert ModelArgs(tiny=True).resolve_dir() == path
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_omni_moe"


def test_tiny_model_has_the_real_codec_layout(checkpoint: Checkpoint) -> None:
    talker = checkpoint.config.talker_config
    code2wav = checkpoint.config.code2wav_config
    assert talker.codec_eos_token_id == 2150
    assert talker.num_code_groups == code2wav.num_quantizers == 16
    assert talker.code_predictor_config.vocab_size == code2wav.codebook_size == 2048
    upsample = 1
    for factor in (*code2wav.upsampling_ratios, *code2wav.upsample_rates):
        upsample *= factor
    assert upsample == 1920  # 80 ms per frame at 24 kHz, as the real model


# --------------------------------------------------------------------------- bad dirs


def _copy_without(src: Path, dst: Path, *skip: str) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in skip:
            shutil.copy(entry, dst / entry.name)
    return dst


def test_missing_model_dir_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")


def test_model_path_that_is_a_file_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a directory"):
        Checkpoint.open(tmp_path / "model.bin")


def test_dir_without_config_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"no config\.json"):
        Checkpoint.open(tmp_path)


def test_other_model_type_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="'llama' checkpoint, not Qwen3-Omni"):
        Checkpoint.open(tmp_path)


def test_checkpoint_without_weights_is_rejected(tmp_path: Path) -> None:
    bare = _copy_without(tiny_dir(), tmp_path / "bare", "model.safetensors")
    with pytest.raises(ModelError, match="no safetensors weights"):
        Checkpoint.open(bare)


def test_incomplete_checkpoint_is_an_error_not_random_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    partial = _copy_without(tiny_dir(), tmp_path / "partial", "model.safetensors")
    weights = load_file(tiny_dir() / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("talker.")}, partial / "model.safetensors"
    )
    checkpoint = Checkpoint.open(partial)
    checkpoint.load_code2wav()  # the parts that are there still load
    with pytest.raises(ModelError, match="does not hold a complete talker"):
        checkpoint.load_talker()


def test_missing_tokenizer_is_a_model_error(tmp_path: Path) -> None:
    bare = _copy_without(tiny_dir(), tmp_path / "notok", "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(ModelError, match="tokenizer"):
        Checkpoint.open(bare).load_tokenizer()


# --------------------------------------------------------------------------- executor args


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"tiny": True, "model_dir": "/x"}, "both tiny"),
        ({"tiny": "yes"}, "true or false"),
        ({"seed": -1}, "seed"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu:9"}, "device"),
        ({"num_threads": 0}, "num_threads"),
        ({"model_path": "/x"}, "unknown executor_args"),
    ],
)
def test_bad_executor_args_are_config_errors(args: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelArgs.from_executor_args(args)


def test_factory_with_a_bad_model_dir_fails_with_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        qwen3_omni.create_code2wav(model_dir=str(tmp_path / "missing"))


# --------------------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_round_trips_text_offline() -> None:
    tokenizer = load_tokenizer(model_dir=str(tiny_dir()))
    for name in TINY_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(name) >= 0
    text = "Hello, wörld! 😀 Tell me a story."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    prompt = encode_chat_prompt(tokenizer, text, system="Be brief.")
    assert tokenizer.decode(prompt) == format_chat_prompt(text, system="Be brief.")
    # Role words are single tokens: the Talker finds turns by the token after <|im_start|>.
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    roles = [prompt[i + 1] for i, t in enumerate(prompt) if t == im_start]
    assert roles == [tokenizer.convert_tokens_to_ids(w) for w in ("system", "user", "assistant")]


# --------------------------------------------------------------------------- registry


def test_executors_register_under_the_pipeline_names() -> None:
    registry = ComponentRegistry()
    register_executors(registry.executors)
    voice = (RECOGNIZER_EXECUTOR, SMOLLM2_EXECUTOR, VOICE_EXECUTOR, SPHINX_ALIGNER_EXECUTOR)
    tts = qwen3_tts.EXECUTOR_NAMES
    assert set(registry.executors.names()) == {*EXECUTOR_NAMES, *tts, ALIGNER_EXECUTOR, *voice}
    assert {s.executor for s in load_pipeline("qwen3-tts-tiny", registry=None).stages} == {
        *tts,
        SPHINX_ALIGNER_EXECUTOR,
    }
    tiny = load_pipeline("qwen3-omni-tiny", registry=None)
    assert {stage.executor for stage in tiny.stages} == set(EXECUTOR_NAMES)
    assert tuple(stage.executor for stage in load_pipeline("voice-cpu", registry=None).stages) == voice
    with pytest.raises(ConfigError, match="already registered"):
        register_executors(registry.executors)
    register_executors(registry.executors, replace=True)


@pytest.mark.parametrize("package", [models, qwen3_omni, qwen3_tts, voice_family, asr_family])
def test_public_surface(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert sorted(names) == sorted(set(names))
    for name in names:
        assert hasattr(package, name), name
