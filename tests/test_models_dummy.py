"""``load_format: dummy``: models from a config alone, every tensor initialized, routers that
route; the shipped full-size config; the dummy tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.hf import dummy_tokenizer
from omnirelay.models.qwen3_omni import Checkpoint, encode_chat_prompt
from omnirelay.models.qwen3_omni.dummy import FULL_SIZE_CONFIG, redraw_moe
from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.talker_input import assistant_start, user_positions
from tests.test_models_support import single_thread, tiny_dir


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module")
def dummy() -> Checkpoint:
    return open_checkpoint(ModelArgs(tiny=True, load_format="dummy", seed=3))


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@pytest.mark.parametrize("part", ["thinker", "talker", "code2wav"])
def test_every_parameter_of_a_dummy_part_is_finite(dummy: Checkpoint, part: str) -> None:
    model = getattr(dummy, f"load_{part}")()
    assert not model.training
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        assert not param.requires_grad, name
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            assert torch.isfinite(buf).all(), name
    build = model.omnirelay_build
    assert build.part == part and build.num_params == sum(p.numel() for p in model.parameters())


def test_dummy_routers_spread_tokens_over_the_experts(dummy: Checkpoint) -> None:
    std = float(dummy.config.initializer_range)
    for part in ("thinker", "talker"):
        model = getattr(dummy, f"load_{part}")()
        routers = _routers(model)
        assert routers, part
        for router in routers:
            weight = router.weight
            assert abs(float(weight.std()) - std) < 0.5 * std, part
            hidden = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(0))
            _, _, chosen = router(hidden)
            # Degenerate (zero or constant) routers send every token to the same experts.
            assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 1, part
            assert len(set(chosen.flatten().tolist())) == weight.shape[0], part


def test_dummy_weights_are_reproducible_and_follow_the_seed() -> None:
    def talker(seed: int) -> dict[str, torch.Tensor]:
        return (
            open_checkpoint(ModelArgs(tiny=True, load_format="dummy", seed=seed)).load_talker().state_dict()
        )

    a, b, c = talker(5), talker(5), talker(6)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_redraw_moe_covers_every_router_and_experts_block(dummy: Checkpoint) -> None:
    talker = dummy.load_talker()
    blocks = [m for m in talker.modules() if type(m).__name__.endswith(("Experts", "TopKRouter"))]
    expected = sum(len(list(m.parameters(recurse=False))) for m in blocks)
    with torch.no_grad():
        for m in blocks:
            for p in m.parameters(recurse=False):
                p.zero_()
    assert redraw_moe(talker, 0.02) == expected
    assert all(float(p.abs().sum()) > 0 for m in blocks for p in m.parameters(recurse=False))


def test_the_shipped_full_size_config_is_the_30b_model() -> None:
    checkpoint = Checkpoint.open(FULL_SIZE_CONFIG, load_format="dummy")
    config = checkpoint.config
    text = config.thinker_config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_experts, text.num_experts_per_tok) == (
        48,
        2048,
        128,
        8,
    )
    talker = config.talker_config.text_config
    assert (talker.num_hidden_layers, talker.num_experts, talker.num_experts_per_tok) == (20, 128, 6)
    assert config.talker_config.accept_hidden_layer == 24
    assert checkpoint.dtype == torch.bfloat16
    # Without load_format dummy it is no checkpoint: there are no weights.
    with pytest.raises(ModelError, match="not a directory"):
        Checkpoint.open(FULL_SIZE_CONFIG)


def test_dummy_without_a_source_is_the_full_size_config() -> None:
    args = ModelArgs(load_format="dummy")
    assert not args.is_tiny and args.resolve_dir() == FULL_SIZE_CONFIG
    assert ModelArgs(tiny=True, load_format="dummy").is_tiny
    assert ModelArgs().is_tiny


def test_dummy_tokenizer_carries_the_config_ids() -> None:
    config = Checkpoint.open(FULL_SIZE_CONFIG, load_format="dummy").config
    tok = Checkpoint.open(FULL_SIZE_CONFIG, load_format="dummy").load_tokenizer()
    ids = encode_chat_prompt(tok, "Hello, who are you? é")
    start = assistant_start(ids, config.im_start_token_id, config.assistant_token_id)
    assert start == len(ids) - 3
    assert user_positions(ids, config.im_start_token_id, config.user_token_id)
    assert tok.convert_tokens_to_ids("<|tts_pad|>") == config.tts_pad_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") == config.im_end_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHello, who are you? é\nassistant\n"
    assert max(t for t in ids if t < 256) < 256  # text is bytes


def test_dummy_tokenizer_rejects_a_config_without_chat_tokens() -> None:
    with pytest.raises(ModelError, match="im_start"):
        dummy_tokenizer({"im_end_token_id": 5})
    with pytest.raises(ModelError, match="collide"):
        dummy_tokenizer({"im_start_token_id": 7, "im_end_token_id": 9})


def test_dummy_needs_only_a_config_json(tmp_path: Path) -> None:
    shutil.copy(tiny_dir() / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelError, match="no safetensors weights"):
        Checkpoint.open(tmp_path)
    checkpoint = open_checkpoint(ModelArgs(model_dir=str(tmp_path), load_format="dummy"))
    assert checkpoint.load_code2wav().omnirelay_build.part == "code2wav"
    assert (
        checkpoint.load_tokenizer().convert_tokens_to_ids("<|im_start|>")
        == checkpoint.config.im_start_token_id
    )


def test_dummy_checks_the_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="not Qwen3-Omni"):
        Checkpoint.open(tmp_path, load_format="dummy")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"load_format": "pt"}, "load_format"),
        ({"runner": "fast"}, "runner"),
        ({"cuda_graphs": "yes"}, "cuda_graphs"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 8}, "max_model_len"),
    ],
)
def test_bad_runner_and_load_args_are_config_errors(args: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelArgs.from_executor_args(args)


def test_the_static_runner_is_the_cuda_default() -> None:
    assert ModelArgs(device="cuda:0").uses_static_runner()
    assert not ModelArgs().uses_static_runner()
    assert ModelArgs(runner="static").uses_static_runner()
    assert not ModelArgs(device="cuda:0", runner="dynamic").uses_static_runner()
