"""The voice pipeline's Thinker from a transformers checkpoint (``--model PATH`` with
``--pipeline voice-cpu``, or ``executor_args.model_dir``): a tiny random Llama with a
byte-level tokenizer whose chat template is not SmolLM2's, saved with ``save_pretrained``.
Its prompts are that template's rendering, it stops on the template's end-of-turn token
and its EOS, and ``omnirelay run`` answers with it; a directory without a chat template
is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnirelay.cli.main import main
from omnirelay.cli.session import load_run_config, open_prompt_side
from omnirelay.engine.interfaces import BatchItem, SamplingParams
from omnirelay.errors import ModelError
from omnirelay.models import checkpoint_stages
from omnirelay.models.voice.chat_model import ChatTokenizer, load_chat_tokenizer
from omnirelay.models.voice.smollm2 import SmolLM2Executor, create_smollm2

#: Not ChatML: a prompt in this layout cannot come from the built-in SmolLM2 template.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|end_turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def write_chat_model(target: Path, *, template: str | None = TEMPLATE, seed: int = 0) -> Path:
    """A tiny random LlamaForCausalLM and its tokenizer (printable ASCII bytes and three
    special tokens), saved the way transformers saves a checkpoint."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # Byte-level symbols of printable ASCII, the space (Ġ) and the newline (Ċ).
    symbols = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    vocab = {"<unk>": 0, **{s: i + 1 for i, s in enumerate(symbols)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|bos|>", "<|eos|>", "<|end_turn|>")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", unk_token="<unk>"
    )
    if template is not None:
        tokenizer.chat_template = template
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(target))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(str(target))
    return target


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_model(tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def tokenizer(chat_dir: Path) -> ChatTokenizer:
    return load_chat_tokenizer(chat_dir)


def _template_ids(chat_dir: Path, turns: list[dict[str, str]]) -> list[int]:
    """The prompt as transformers renders the checkpoint's own template."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_dir), local_files_only=True)
    text = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.startswith("<|bos|>[")
    return list(hf.encode(text, add_special_tokens=False))


def test_prompts_are_the_checkpoints_own_template(chat_dir: Path, tokenizer: ChatTokenizer) -> None:
    assert tokenizer.chat_text([("user", "hi")]) == "<|bos|>[user] hi<|end_turn|>\n[assistant] "
    turns = [("developer", "Be brief."), ("user", "hi there")]
    assert tokenizer.chat_ids(turns) == _template_ids(
        chat_dir, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    )
    end_turn, eos = (tokenizer.encode(t)[0] for t in ("<|end_turn|>", "<|eos|>"))
    # An answer ends with the end-of-turn token the template writes; EOS stops it too.
    assert tokenizer.eos_token_id == end_turn and tokenizer.stop_token_ids == {end_turn, eos}
    assert tokenizer.decode([*tokenizer.encode("a b"), end_turn]) == "a b"


def test_a_checkpoint_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    plain = write_chat_model(tmp_path / "plain", template=None)
    with pytest.raises(ModelError, match="no chat template"):
        load_run_config("voice-cpu", model=str(plain))
    with pytest.raises(ModelError, match="does not exist"):
        load_run_config("voice-cpu", model=str(tmp_path / "missing"))
    (tmp_path / "omni").mkdir()
    (tmp_path / "omni" / "config.json").write_text('{"model_type": "qwen3_omni_moe"}')
    with pytest.raises(ModelError, match="not load as a causal LM"):
        load_run_config("voice-cpu", model=str(tmp_path / "omni"))


def test_model_replaces_only_the_thinkers_source(chat_dir: Path) -> None:
    config = load_run_config("voice-cpu", model=str(chat_dir), device="cpu")
    assert checkpoint_stages(config)[0] == [1]  # the Thinker; not the recognizer, voice or aligner
    thinker = config.stages[1]
    assert thinker.executor == "smollm2.thinker"
    assert thinker.executor_args == {"num_threads": 1, "model_dir": str(chat_dir.resolve()), "device": "cpu"}
    assert (
        "model_dir" not in config.stages[2].executor_args and "device" not in config.stages[2].executor_args
    )
    prompts = open_prompt_side(config)
    assert prompts.encode_prompt("hi") == _template_ids(chat_dir, [{"role": "user", "content": "hi"}])


def _step_until_done(
    ex: SmolLM2Executor, prompts: dict[str, list[int]], **inputs: object
) -> dict[str, list[int]]:
    """All requests in each step, as the AR scheduler drives them."""
    sampling = SamplingParams(seed=0, temperature=0.2, top_p=0.9, max_tokens=24)
    ids = {rid: list(p) for rid, p in prompts.items()}
    computed = dict.fromkeys(prompts, 0)
    live = set(prompts)
    while live:
        batch = [
            BatchItem(
                internal_id=rid,
                external_id=rid,
                input_token_ids=ids[rid][computed[rid] :],
                all_token_ids=list(ids[rid]),
                num_computed_tokens=computed[rid],
                is_prefill=computed[rid] == 0,
                sampling=sampling,
                additional_information=None,
                inputs=inputs.get(rid),
            )
            for rid in sorted(live)
        ]
        for item, result in zip(batch, ex.step(batch)):
            rid = item.internal_id
            computed[rid] = len(ids[rid])
            ids[rid] += result.token_ids
            if result.finished or len(ids[rid]) - len(prompts[rid]) >= sampling.max_tokens:
                live.discard(rid)
                ex.release(rid)
    return {rid: ids[rid][len(prompts[rid]) :] for rid in prompts}


def test_the_executor_runs_the_checkpoint(chat_dir: Path, tokenizer: ChatTokenizer) -> None:
    ex = create_smollm2(model_dir=str(chat_dir), num_threads=1, dtype="auto", runner="dynamic")
    assert isinstance(ex.tokenizer, ChatTokenizer) and ex.eos_token_ids == tokenizer.stop_token_ids
    a = tokenizer.chat_ids([("user", "hi")])
    b = tokenizer.chat_ids([("user", "tell me more")])
    alone = _step_until_done(ex, {"a": a})
    both = _step_until_done(ex, {"a": a, "b": b})
    assert alone["a"] and both["a"] == alone["a"]  # batched decode rows compute what one does alone
    text = "Read this: 42!"
    spoken = _step_until_done(ex, {"s": tokenizer.chat_ids([("user", text)])}, s={"speak_text": text})
    assert spoken["s"] == [*tokenizer.encode(text), tokenizer.eos_token_id]  # ends with the end of turn
    assert ex.num_live_requests() == 0 and ex.leak_state() == {}
    with pytest.raises(ModelError, match="dtype"):
        create_smollm2(model_dir=str(chat_dir), dtype="int4")
    with pytest.raises(ModelError, match="runner"):
        create_smollm2(model_dir=str(chat_dir), runner="static")


def test_run_answers_with_the_checkpoint(
    chat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``omnirelay run --pipeline voice-cpu --model DIR``: real stage processes, a short answer."""
    out = tmp_path / "run.json"
    argv = ["run", "--pipeline", "voice-cpu", "--model", str(chat_dir), "--modalities", "text"]
    argv += ["--prompt", "hi", "--max-tokens", "4", "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    answer = capsys.readouterr().out.split("\n", 1)[0]
    data = json.loads(out.read_text())
    # The Thinker got the template's rendering of the prompt (not SmolLM2's ChatML).
    assert data["num_prompt_tokens"] == len(_template_ids(chat_dir, [{"role": "user", "content": "hi"}]))
    assert answer.strip() and data["finish_reason"] in ("length", "stop")
    assert data["shutdown"] == {"num_killed": 0, "num_objects_left": 0}
