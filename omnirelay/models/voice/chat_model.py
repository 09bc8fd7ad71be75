"""Any transformers causal LM with a chat template as the voice pipeline's Thinker.

A ``smollm2.thinker`` stage with ``executor_args.model_dir`` (``omnirelay run --pipeline
voice-cpu --model PATH|owner/name``) loads that checkpoint instead of the built-in
SmolLM2-135M: SmolLM2-360M-Instruct, Qwen2.5-0.5B-Instruct, any model ``transformers``
loads as ``AutoModelForCausalLM`` whose tokenizer has a chat template. It is used as it
is on disk (a repo id: its snapshot in the hub's cache, :mod:`omnirelay.models.checkpoints`);
nothing is prepared or cached by omnirelay.

* :class:`ChatTokenizer` — the checkpoint's tokenizer with the interface the executor,
  the prompt side and the detokenizer use (``encode``, ``decode``, ``len``,
  :meth:`~ChatTokenizer.chat_ids`): prompts are the tokenizer's own chat template, and
  generation stops on its EOS, the generation config's EOS ids and the template's
  end-of-turn token (what the template writes after an assistant turn); a template
  that takes tools renders them (:attr:`~ChatTokenizer.chat_tools`).
* :func:`open_chat_model` — checks a directory before anything loads (the ``--model``
  check): config, a causal LM type, weights, a tokenizer with a chat template.
* :func:`load_chat_tokenizer`, :func:`load_chat_model` — the tokenizer, the model.

Errors are :class:`~omnirelay.errors.ModelError` and say what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnirelay.errors import ModelError
from omnirelay.models.checkpoints import resolve_checkpoint
from omnirelay.models.tools import ChatTemplateTools

__all__ = [
    "DTYPES",
    "ChatTokenizer",
    "check_chat_model",
    "load_chat_model",
    "load_chat_tokenizer",
    "open_chat_model",
]

#: ``dtype`` of the model: ``auto`` is float32 on the CPU (half precision is slow there)
#: and the checkpoint's own dtype on an accelerator.
DTYPES = ("auto", "float32", "bfloat16", "float16")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: An assistant turn's text, to find what the template writes after one.
_PROBE = "omnirelay end-of-turn probe"


class ChatTokenizer:
    """A checkpoint's tokenizer, speaking in its own chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, extra_stop_ids: Sequence[int] = (), source: str = "") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError(
                f"the tokenizer in {source or 'the model directory'!r} has no chat template "
                "(chat_template.jinja, or chat_template in tokenizer_config.json); the Thinker needs an "
                "instruct or chat model"
            )
        self._tok = tokenizer
        #: the template seen for tools (:mod:`omnirelay.models.tools`)
        self.chat_tools = ChatTemplateTools(tokenizer.apply_chat_template)
        end_of_turn = self._end_of_turn_id()
        eos = tokenizer.eos_token_id
        stops = [t for t in (end_of_turn, eos, *extra_stop_ids) if isinstance(t, int)]
        if not stops:
            raise ModelError(
                f"the tokenizer in {source or 'the model directory'!r} has no EOS token and its chat template "
                "ends an assistant turn with no special token: nothing would stop an answer"
            )
        #: The token a complete answer ends with (the end-of-turn token, else EOS).
        self.eos_token_id: int = stops[0]
        self.stop_token_ids = frozenset(stops)

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in self._tok.encode(text, add_special_tokens=add_special_tokens)]

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return str(
            self._tok.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            )
        )

    def chat_text(self, messages: Sequence[tuple[str, str]]) -> str:
        """The template's rendering of ``messages`` and the open assistant turn;
        ``developer`` is ``system``. A template that refuses the turns (a role it does not
        know, turns out of order) is a ValueError."""
        turns = [
            {"role": "system" if role == "developer" else role, "content": content}
            for role, content in messages
        ]
        try:
            text = self._tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError, raise_exception() in the template …
            raise ValueError(f"the model's chat template refused these turns: {exc}") from exc
        return str(text)

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        # The template writes the special tokens (a BOS included) itself.
        return self.encode(self.chat_text(messages))

    def _end_of_turn_id(self) -> int | None:
        """The first token the template writes after an assistant turn, when it is special."""
        try:
            text = self._tok.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                tokenize=False,
            )
        except Exception:  # a template that needs other turns: EOS alone
            return None
        at = str(text).rfind(_PROBE)
        if at < 0:
            return None
        after = self.encode(str(text)[at + len(_PROBE) :])
        special = set(self._tok.all_special_ids) | {
            int(i) for i, t in self._tok.added_tokens_decoder.items() if t.special
        }
        return after[0] if after and after[0] in special else None


def open_chat_model(path: str | Path) -> Path:
    """The checkpoint directory of ``path`` (a local path or a repo id), checked to hold a
    causal LM with weights and a tokenizer with a chat template; raises ModelError saying
    what is wrong."""
    root = resolve_checkpoint(path, prefer_cache=True)
    if not root.exists():
        raise ModelError(
            f"model directory {str(root)!r} does not exist; pass --model with a local checkpoint path "
            "or a Hugging Face repo id (owner/name)"
        )
    if not root.is_dir():
        raise ModelError(f"model path {str(root)!r} is not a directory; pass the checkpoint directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{str(root)!r} has no config.json; it is not a Hugging Face checkpoint directory")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelError(f"cannot read {str(config_file)!r}: {exc}") from exc
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(
            f"{str(root)!r} holds a {model_type!r} checkpoint, which transformers does not load as a causal "
            "LM (AutoModelForCausalLM); the voice pipeline's Thinker needs a text chat model"
        )
    if not any((root / name).is_file() for name in _WEIGHT_FILES):
        raise ModelError(f"{str(root)!r} has no weights ({', '.join(_WEIGHT_FILES)})")
    return root


def check_chat_model(path: str, load_format: str) -> None:
    """``--model``'s check for a voice pipeline: :func:`open_chat_model`, and its tokenizer."""
    load_chat_tokenizer(open_chat_model(path))


def load_chat_tokenizer(directory: str | Path) -> ChatTokenizer:
    """The checkpoint's tokenizer (``AutoTokenizer``, local files only), with its stop ids."""
    from transformers import AutoTokenizer

    from omnirelay.models.hf import quiet_transformers

    root = Path(directory)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer from {str(root)!r}: {exc}") from exc
    return ChatTokenizer(tokenizer, extra_stop_ids=_generation_eos_ids(root), source=str(root))


def load_chat_model(directory: str | Path, *, device: str = "cpu", dtype: str = "auto") -> Any:
    """``AutoModelForCausalLM`` from ``directory`` on ``device``, in eval mode, in ``dtype``
    (:data:`DTYPES`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from omnirelay.models.hf import quiet_transformers

    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    chosen: Any = getattr(torch, dtype) if dtype != "auto" else None
    if chosen is None:
        chosen = torch.float32 if torch.device(device).type == "cpu" else "auto"
    root = Path(directory)
    cls: Any = AutoModelForCausalLM  # from_pretrained's decorator hides its signature from mypy
    try:
        with quiet_transformers():
            model = cls.from_pretrained(str(root), dtype=chosen, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load a causal LM from {str(root)!r}: {exc}") from exc
    model.requires_grad_(False)
    return model.to(device).eval()


def _generation_eos_ids(root: Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list), if any."""
    try:
        value = json.loads((root / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
