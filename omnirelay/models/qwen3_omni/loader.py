"""Loading Qwen3-Omni parts from a checkpoint directory: a local one, or a Hugging Face
repo id's snapshot in the hub's cache (:mod:`omnirelay.models.checkpoints`).

* :class:`ModelArgs` — the executors' ``executor_args`` (``tiny``, ``seed``,
  ``model_dir``, ``load_format``, ``device``, ``dtype``, ``num_threads`` and the GPU
  runner's ``runner``, ``cuda_graphs``, ``max_num_seqs``, ``max_model_len``), validated at
  construction; :meth:`ModelArgs.resolve_dir` builds the tiny model on first use, finds
  ``model_dir`` (a path, or a repo id in the hub's cache), or names the shipped full-size
  config.
* :class:`Checkpoint` — one opened checkpoint directory: its composite config, and
  :meth:`~Checkpoint.load_thinker` / :meth:`~Checkpoint.load_talker` /
  :meth:`~Checkpoint.load_code2wav` / :meth:`~Checkpoint.load_tokenizer`.
* :func:`open_checkpoint` — ``ModelArgs`` → ``Checkpoint`` (the one path shared by the
  tiny model and ``--model PATH``).

``load_format: dummy`` builds each part from the config alone with random weights,
directly on the device (:mod:`omnirelay.models.qwen3_omni.dummy`): no weights are read, and with no
``model_dir`` (and no ``tiny``) the config is the shipped Qwen3-Omni-30B-A3B one. A
directory without tokenizer files then gets the dummy byte-level tokenizer.

A stage loads only its own part: ``thinker.*`` / ``talker.*`` / ``code2wav.*`` weights of
the full checkpoint, through ``from_pretrained`` with the part's prefix stripped, so the
library's own weight conversions (fused MoE experts, renamed modules) still apply. Every
load passes ``local_files_only=True`` (a repo id was fetched before, by the front's
``prepare`` or ``--model``); a part with weights missing from the checkpoint is
an error, never a silently random model. Errors are :class:`~omnirelay.errors.ModelError`
and say what to fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.checkpoints import resolve_checkpoint
from omnirelay.models.hf import quiet_transformers
from omnirelay.models.qwen3_omni.tiny import build_tiny

__all__ = [
    "DEFAULT_SLOTS",
    "LOAD_FORMATS",
    "MODEL_TYPE",
    "RUNNERS",
    "Checkpoint",
    "ModelArgs",
    "open_checkpoint",
    "resolve_dtype",
]

#: ``model_type`` of a Qwen3-Omni checkpoint's ``config.json``.
MODEL_TYPE = "qwen3_omni_moe"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
#: ``auto``: the weights of the checkpoint; ``dummy``: random weights from the config alone.
LOAD_FORMATS = ("auto", "dummy")
#: ``auto``: the static runner on CUDA, the dynamic one elsewhere; ``dynamic``: per-request
#: ``transformers`` caches stacked per step (:mod:`omnirelay.models.kv`); ``static``: the
#: slot KV cache and CUDA graphs of :mod:`omnirelay.models.runner`.
RUNNERS = ("auto", "dynamic", "static")
#: KV slots of a static runner whose ``max_num_seqs`` is not given and not sized from memory
DEFAULT_SLOTS = 64
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Where a stage's model comes from and where it runs (the stage's ``executor_args``).

    Exactly one source: ``tiny: true`` (with ``seed``) or ``model_dir: PATH``; with
    neither, the tiny model is used (the default pipeline) — or, with ``load_format:
    dummy``, the shipped full-size config. ``dtype`` is ``"auto"`` (the checkpoint's dtype;
    float32 for the tiny model), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    ``num_threads`` sets torch's intra-op threads of the stage process. ``seed`` also seeds
    a dummy model's weights.

    The static runner (``runner``: see :data:`RUNNERS`) holds KV for ``max_num_seqs``
    requests of up to ``max_model_len`` tokens each, allocated at startup (not given: as
    many as fit the memory the process's stages leave, capped by the stage's
    ``max_num_seqs``, where the process sizes them — a device group, or a stage alone on
    its device; elsewhere :data:`DEFAULT_SLOTS`; docs/design.md §12); with
    ``cuda_graphs`` its steps are captured as CUDA graphs at startup. ``compile``
    compiles the Talker frame's code-predictor tail with ``torch.compile`` before its
    graphs are captured (None, the default: on for the static runner on CUDA with CUDA
    graphs; the compiled kernels are cached on disk, so a restart compiles faster).
    ``stateful`` (Code2Wav only): a streamed request keeps its decoder state between
    chunks, so each chunk decodes only its new frames (false: every chunk is decoded as a
    window with its left context).
    """

    tiny: bool = False
    seed: int = 0
    model_dir: str | None = None
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    num_threads: int | None = None
    #: the Talker only: build its prefill from the prompt's text (a TTS pipeline without a
    #: Thinker stage; :class:`omnirelay.models.qwen3_omni.talker.TextConditioner`)
    text_input: bool = False
    runner: str = "auto"
    cuda_graphs: bool = True
    compile: bool | None = None
    stateful: bool = True
    #: KV slots; None (not given): sized from the device memory where the process sizes
    #: them (:mod:`omnirelay.models.runner.memory`), else :data:`DEFAULT_SLOTS`
    max_num_seqs: int | None = None
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.tiny, bool):
            raise ConfigError(f"executor_args.tiny must be true or false, got {self.tiny!r}")
        if not isinstance(self.text_input, bool):
            raise ConfigError(f"executor_args.text_input must be true or false, got {self.text_input!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"executor_args.seed must be an int >= 0, got {self.seed!r}")
        if self.model_dir is not None and (not isinstance(self.model_dir, str) or not self.model_dir):
            raise ConfigError(
                f"executor_args.model_dir must be a non-empty path string, got {self.model_dir!r}"
            )
        if self.tiny and self.model_dir is not None:
            raise ConfigError(
                "executor_args sets both tiny: true and model_dir; use tiny for the seeded test model "
                "or model_dir for a real checkpoint, not both"
            )
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(
                f"executor_args.device must be a device string such as 'cpu' or 'cuda:0', got {self.device!r}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"executor_args.device {self.device!r} is not a torch device: {exc}") from exc
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(
                f"executor_args.dtype {self.dtype!r} is not supported; use 'auto', {', '.join(map(repr, _DTYPES))}"
            )
        if self.num_threads is not None and (
            isinstance(self.num_threads, bool)
            or not isinstance(self.num_threads, int)
            or self.num_threads < 1
        ):
            raise ConfigError(f"executor_args.num_threads must be an int >= 1, got {self.num_threads!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"executor_args.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.runner not in RUNNERS:
            raise ConfigError(f"executor_args.runner must be one of {RUNNERS}, got {self.runner!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"executor_args.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if not isinstance(self.stateful, bool):
            raise ConfigError(f"executor_args.stateful must be true or false, got {self.stateful!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ConfigError(f"executor_args.compile must be true, false or null, got {self.compile!r}")
        for name, low in (("max_num_seqs", 1), ("max_model_len", 16)):
            value = getattr(self, name)
            if name == "max_num_seqs" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"executor_args.{name} must be an int >= {low}, got {value!r}")

    @classmethod
    def from_executor_args(cls, args: Mapping[str, Any]) -> ModelArgs:
        """Validate a stage's ``executor_args`` mapping; unknown keys are an error."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in args if k not in known)
        if unknown:
            raise ConfigError(f"unknown executor_args {unknown}; known keys: {sorted(known)}")
        return cls(**dict(args))

    @property
    def num_slots(self) -> int:
        """``max_num_seqs``, or :data:`DEFAULT_SLOTS` where it is not given."""
        return self.max_num_seqs if self.max_num_seqs is not None else DEFAULT_SLOTS

    @property
    def is_dummy(self) -> bool:
        return self.load_format == "dummy"

    @property
    def is_tiny(self) -> bool:
        """The source is the tiny model (built and cached on first use)."""
        return self.model_dir is None and (self.tiny or not self.is_dummy)

    def resolve_dir(self) -> Path:
        """The checkpoint: the cached tiny model (built on first use), ``model_dir`` (a local
        path, or a repo id's snapshot in the hub's cache), or (dummy with neither) the
        shipped full-size config file."""
        if self.model_dir is not None:
            return resolve_checkpoint(self.model_dir, prefer_cache=True)
        if self.is_tiny:
            return build_tiny(None, seed=self.seed)
        from omnirelay.models.qwen3_omni.dummy import FULL_SIZE_CONFIG

        return FULL_SIZE_CONFIG

    def uses_static_runner(self) -> bool:
        """Whether the AR executors run on :mod:`omnirelay.models.runner`."""
        if self.runner == "auto":
            return torch.device(self.device).type == "cuda"
        return self.runner == "static"

    def compiles(self) -> bool:
        """Whether the static runner compiles the Talker frame's tail (see ``compile``)."""
        if self.compile is not None:
            return self.compile and self.uses_static_runner()
        return self.uses_static_runner() and self.cuda_graphs and torch.device(self.device).type == "cuda"

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        return resolve_dtype(self.dtype, checkpoint_dtype)

    def apply_process_settings(self) -> None:
        """Process-wide torch settings for this stage process (each stage has its own)."""
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        if torch.device(self.device).type == "cpu":
            # Random tiny weights produce denormals that make CPU kernels crawl.
            torch.set_flush_denormal(True)


class Checkpoint:
    """A Qwen3-Omni checkpoint directory; validated when opened, parts loaded on demand."""

    def __init__(
        self,
        path: Path,
        config: Any,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        load_format: str = "auto",
        seed: int = 0,
    ) -> None:
        self.path = path  # the checkpoint directory (a dummy model: its config's directory)
        self.config = config  # Qwen3OmniMoeConfig
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else _config_dtype(config) or torch.float32
        self.load_format = load_format
        self.seed = seed

    @property
    def is_dummy(self) -> bool:
        return self.load_format == "dummy"

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
    ) -> Checkpoint:
        """Check ``path`` is a Qwen3-Omni checkpoint and read its config (no weights yet).

        With ``load_format="dummy"`` no weights are needed, and ``path`` may also be a
        config file (``config.json`` or the shipped full-size one)."""
        if load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        dummy = load_format == "dummy"
        root = resolve_checkpoint(path, prefer_cache=True)
        if not root.exists():
            raise ModelError(
                f"model directory {str(root)!r} does not exist; pass --model with a local checkpoint path "
                "or a Hugging Face repo id (owner/name)"
            )
        if dummy and root.is_file():
            config_file, root = root, root.parent
        elif not root.is_dir():
            raise ModelError(f"model path {str(root)!r} is not a directory; pass the checkpoint directory")
        else:
            config_file = root / "config.json"
        if not config_file.is_file():
            raise ModelError(
                f"{str(root)!r} has no config.json; it is not a Hugging Face checkpoint directory"
            )
        raw = _read_json(config_file)
        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise ModelError(
                f"{str(root if config_file == root / 'config.json' else config_file)!r} holds a "
                f"{model_type!r} checkpoint, not Qwen3-Omni ({MODEL_TYPE!r}); "
                "point --model at a Qwen3-Omni checkpoint directory"
            )
        if not dummy and not any((root / name).is_file() for name in _WEIGHT_FILES):
            raise ModelError(f"{str(root)!r} has no safetensors weights ({' or '.join(_WEIGHT_FILES)})")
        from transformers import Qwen3OmniMoeConfig

        try:
            with quiet_transformers():
                config = Qwen3OmniMoeConfig.from_pretrained(
                    root if config_file == root / "config.json" else config_file, local_files_only=True
                )
        except Exception as exc:  # the library raises OSError, ValueError, TypeError …
            raise ModelError(f"invalid Qwen3-Omni config in {str(config_file)!r}: {exc}") from exc
        if not getattr(config, "enable_audio_output", True):
            raise ModelError(
                f"{str(root)!r} is a text-only Qwen3-Omni checkpoint (enable_audio_output is false)"
            )
        return cls(
            root,
            config,
            device=device,
            dtype=resolve_dtype(dtype, _config_dtype(config)),
            load_format=load_format,
            seed=seed,
        )

    # ---- parts

    def load_thinker(self) -> Any:
        """``Qwen3OmniMoeThinkerForConditionalGeneration`` with the ``thinker.*`` weights."""
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        return self._load_part(
            Qwen3OmniMoeThinkerForConditionalGeneration, "thinker", self.config.thinker_config
        )

    def load_talker(self) -> Any:
        """``Qwen3OmniMoeTalkerForConditionalGeneration`` (with its code predictor)."""
        from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

        _register_talker_expert_fusion()
        return self._load_part(
            Qwen3OmniMoeTalkerForConditionalGeneration, "talker", self.config.talker_config
        )

    def load_code2wav(self) -> Any:
        """``Qwen3OmniMoeCode2Wav``; always float32 (a vocoder in half precision adds audible noise)."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        return self._load_part(
            Qwen3OmniMoeCode2Wav, "code2wav", self.config.code2wav_config, dtype=torch.float32
        )

    def load_tokenizer(self) -> Any:
        """The checkpoint's own tokenizer files (``AutoTokenizer``, local files only)."""
        from transformers import AutoTokenizer

        has_files = any((self.path / name).is_file() for name in _TOKENIZER_FILES)
        if self.is_dummy and not has_files:
            from omnirelay.models.hf import dummy_tokenizer

            return dummy_tokenizer(self.config)
        if not has_files:
            raise ModelError(
                f"{str(self.path)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                "copy the checkpoint's tokenizer next to its weights"
            )
        try:
            with quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except Exception as exc:
            raise ModelError(f"cannot load the tokenizer from {str(self.path)!r}: {exc}") from exc
        # The Talker finds turns by these ids: a tokenizer from another model breaks it silently.
        for token, expected in (
            ("<|im_start|>", self.config.im_start_token_id),
            ("<|im_end|>", self.config.im_end_token_id),
        ):
            got = tokenizer.convert_tokens_to_ids(token)
            if got != expected:
                raise ModelError(
                    f"the tokenizer in {str(self.path)!r} maps {token} to {got}, but the model's config says "
                    f"{expected}; the tokenizer does not belong to this checkpoint"
                )
        return tokenizer

    def _load_part(self, cls: Any, prefix: str, config: Any, *, dtype: torch.dtype | None = None) -> Any:
        if self.is_dummy:
            from omnirelay.models.qwen3_omni.dummy import build_part

            return build_part(
                cls, config, part=prefix, device=self.device, dtype=dtype or self.dtype, seed=self.seed
            )
        kwargs: dict[str, Any] = {
            "config": config,
            "local_files_only": True,
            "key_mapping": {rf"^{prefix}\.": ""},
            "dtype": dtype or self.dtype,
            "output_loading_info": True,
        }
        # Straight onto the accelerator needs `accelerate` (device_map); without it the
        # weights pass through host memory first.
        direct = self.device.type != "cpu" and importlib.util.find_spec("accelerate") is not None
        if direct:
            kwargs["device_map"] = {"": str(self.device)}
        try:
            with quiet_transformers():
                model, info = cls.from_pretrained(self.path, **kwargs)
            if not direct and self.device.type != "cpu":
                model = model.to(self.device)
        except Exception as exc:
            raise ModelError(f"cannot load the {prefix} from {str(self.path)!r}: {exc}") from exc
        missing = sorted(info.get("missing_keys") or [])
        mismatched = info.get("mismatched_keys") or []
        if missing or mismatched:
            detail = f"{len(missing)} missing weight(s), e.g. {missing[:3]}" if missing else ""
            if mismatched:
                detail += f"{'; ' if detail else ''}{len(mismatched)} of the wrong shape, e.g. {list(mismatched)[:2]}"
            raise ModelError(
                f"the checkpoint at {str(self.path)!r} does not hold a complete {prefix}: {detail}; "
                "is it a complete Qwen3-Omni checkpoint?"
            )
        model.eval()
        model.requires_grad_(False)
        return model


def open_checkpoint(args: ModelArgs) -> Checkpoint:
    """The checkpoint a stage's ``executor_args`` name (the tiny one is built on first use)."""
    args.apply_process_settings()
    return Checkpoint.open(
        args.resolve_dir(), device=args.device, dtype=args.dtype, load_format=args.load_format, seed=args.seed
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{path} does not hold a JSON object")
    return raw


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """``"auto"`` → the checkpoint's dtype (float32 if it names none); else the named dtype."""
    if name == "auto":
        return checkpoint_dtype if checkpoint_dtype is not None else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use 'auto', {', '.join(map(repr, _DTYPES))}")
    return _DTYPES[name]


def _config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    return None


_TALKER_TEXT_MODEL_TYPE = "qwen3_omni_moe_talker_text"


def _register_talker_expert_fusion() -> None:
    """Let ``from_pretrained`` fuse the Talker's per-expert weights when loaded on its own.

    Checkpoints store MoE experts one by one (``experts.3.gate_proj.weight``); the model
    holds them fused (``experts.gate_up_proj``). The library registers that conversion
    for the full model and the Thinker's text model but not for the Talker's text model,
    so a Talker loaded alone would miss every expert weight. Registering the same
    conversion (the library's ``qwen2_moe`` one) under the Talker's model type fixes that;
    nothing is registered if the library already knows one.
    """
    from transformers import conversion_mapping

    if conversion_mapping.get_checkpoint_conversion_mapping(_TALKER_TEXT_MODEL_TYPE) is not None:
        return
    fused = conversion_mapping.get_checkpoint_conversion_mapping("qwen2_moe")
    if fused is None:
        return  # a library without expert conversions: the missing-weights check reports it
    conversion_mapping.register_checkpoint_conversion_mapping(_TALKER_TEXT_MODEL_TYPE, fused)
