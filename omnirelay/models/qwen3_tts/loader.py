"""Where a Qwen3-TTS stage's model comes from: a local checkpoint, a shipped config, or the tiny one.

* :class:`TTSModelArgs` — a stage's ``executor_args``, validated at construction: the
  source (``model_dir: PATH``; ``tiny: true``, the released variant ``model`` at toy
  widths; or, with ``load_format: dummy``, the shipped config named by ``model``), where it runs (``device``, ``dtype``,
  ``num_threads``), the static runner's sizes and CUDA graphs, the Code2Wav stream state,
  and the Talker's text mode.
* :class:`TTSCheckpoint` — one opened source: both configs, the generation defaults,
  :meth:`~TTSCheckpoint.load_talker`, :meth:`~TTSCheckpoint.load_codec`,
  :meth:`~TTSCheckpoint.load_tokenizer`.

A checkpoint directory is the released layout: ``config.json`` and ``model.safetensors``
(or its index) for the Talker, ``speech_tokenizer/config.json`` and
``speech_tokenizer/model.safetensors`` for the decoder, ``generation_config.json``, and the
Qwen tokenizer's files. Weights load by name (``talker.*``, ``decoder.*``; the speaker
encoder of a Base model and the tokenizer's encoder are not read); a missing, unexpected
or misshapen tensor is a :class:`~omnirelay.errors.ModelError` naming it — never a
silently random model. ``load_format: dummy`` builds from the configs alone with weights
drawn by parameter name on the device (:mod:`~omnirelay.models.qwen3_tts.seeded`); a
directory without tokenizer files, and the shipped configs, get a byte-level tokenizer
with the config's special ids. ``model_dir`` may also be a Hugging Face repo id: its
snapshot in the hub's cache (:mod:`omnirelay.models.checkpoints`), fetched by the front
(``--model``, the family's ``prepare``) before any stage loads it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.checkpoints import resolve_checkpoint
from omnirelay.models.qwen3_tts.codec import TTSCodec
from omnirelay.models.qwen3_tts.model_config import CodecConfig, TTSConfig
from omnirelay.models.qwen3_tts.seeded import fill_seeded
from omnirelay.models.qwen3_tts.talker_model import TTSTalker

__all__ = [
    "LOAD_FORMATS",
    "RUNNERS",
    "SHIPPED_MODELS",
    "GenerationDefaults",
    "TTSCheckpoint",
    "TTSModelArgs",
]

#: ``auto``: the checkpoint's weights; ``dummy``: random weights from the config alone;
#: ``tiny``: the tiny model (:mod:`omnirelay.models.qwen3_tts.tiny`).
LOAD_FORMATS = ("auto", "dummy", "tiny")
#: Qwen3-TTS always runs on the static runner (CUDA graphs on CUDA, eager elsewhere).
RUNNERS = ("auto", "static")
_CONFIGS = Path(__file__).with_name("configs")
#: The released models whose configs ship with omnirelay (``model:`` of ``load_format: dummy``).
SHIPPED_MODELS = {
    "1.7b-customvoice": "qwen3-tts-12hz-1.7b-customvoice.json",
    "0.6b-customvoice": "qwen3-tts-12hz-0.6b-customvoice.json",
    "1.7b-voicedesign": "qwen3-tts-12hz-1.7b-voicedesign.json",
}
SHIPPED_CODEC = "qwen3-tts-tokenizer-12hz.json"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


@dataclass(frozen=True, slots=True)
class TTSModelArgs:
    """A Qwen3-TTS stage's ``executor_args`` (see the module docstring).

    ``max_num_seqs`` / ``max_model_len``: the Talker's KV slots and positions per request
    (prefill + frames), allocated at startup; ``max_num_seqs`` also bounds Code2Wav's
    streams. ``cuda_graphs``: capture the Talker frame and the decoder steps on CUDA.
    ``compile``: compile the code predictor's tail (None: on with CUDA graphs).
    ``stateful``: Code2Wav keeps each stream's decoder state (false: windows with left
    context). ``text_streaming``: the Talker reads the text one token per frame instead
    of all of it in its prefill. ``speaker``: the speaker of a request that names none.
    """

    tiny: bool = False
    seed: int = 0
    model_dir: str | None = None
    model: str = "1.7b-customvoice"
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    num_threads: int | None = None
    runner: str = "auto"
    cuda_graphs: bool = True
    compile: bool | None = None
    stateful: bool = True
    max_num_seqs: int = 64
    max_model_len: int = 4096
    text_streaming: bool = False
    speaker: str | None = None

    def __post_init__(self) -> None:
        for name in ("tiny", "cuda_graphs", "stateful", "text_streaming"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"executor_args.{name} must be true or false, got {getattr(self, name)!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ConfigError(f"executor_args.compile must be true, false or null, got {self.compile!r}")
        for name, low in (("seed", 0), ("max_num_seqs", 1), ("max_model_len", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"executor_args.{name} must be an int >= {low}, got {value!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"executor_args.load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.runner not in RUNNERS:
            raise ConfigError(
                f"executor_args.runner must be one of {', '.join(RUNNERS)} (Qwen3-TTS runs on the static runner), "
                f"got {self.runner!r}"
            )
        if self.model not in SHIPPED_MODELS:
            raise ConfigError(
                f"executor_args.model must be one of {', '.join(SHIPPED_MODELS)}, got {self.model!r}"
            )
        if self.model_dir is not None and (not isinstance(self.model_dir, str) or not self.model_dir):
            raise ConfigError(f"executor_args.model_dir must be a non-empty path, got {self.model_dir!r}")
        if self.is_tiny and self.model_dir is not None:
            raise ConfigError("executor_args: the tiny model takes no model_dir; use one or the other")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(
                f"executor_args.dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {self.dtype!r}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConfigError(f"executor_args.device {self.device!r} is not a torch device: {exc}") from exc
        if self.num_threads is not None and (
            isinstance(self.num_threads, bool)
            or not isinstance(self.num_threads, int)
            or self.num_threads < 1
        ):
            raise ConfigError(f"executor_args.num_threads must be an int >= 1, got {self.num_threads!r}")
        if self.load_format == "auto" and not self.is_tiny and self.model_dir is None:
            raise ConfigError(
                "executor_args names no model: give model_dir (a local checkpoint, omnirelay --model PATH), "
                "tiny: true, or load_format: dummy (random weights of the shipped config named by model)"
            )

    @classmethod
    def from_executor_args(cls, args: Mapping[str, Any]) -> TTSModelArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(f"unknown Qwen3-TTS executor_args {unknown}; known: {sorted(known)}")
        return cls(**dict(args))

    @property
    def is_tiny(self) -> bool:
        return self.tiny or self.load_format == "tiny"

    @property
    def is_dummy(self) -> bool:
        return self.load_format == "dummy"

    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def uses_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.torch_device().type == "cuda"

    def compiles(self) -> bool:
        return self.uses_cuda_graphs() if self.compile is None else self.compile


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The checkpoint's ``generation_config.json`` as the stages use it: the first
    codebook's repetition penalty and minimum length, and the code predictor's sampling
    (the reference's defaults when absent)."""

    repetition_penalty: float = 1.05
    min_new_tokens: int = 2
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationDefaults:
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        try:
            return cls(**values)
        except TypeError as exc:
            raise ModelError(f"generation_config.json: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelError(f"{path} is missing: not a Qwen3-TTS checkpoint directory") from exc
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a JSON object")
    return data


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise ModelError(f"{directory} has no model.safetensors (or its index)")


def load_weights(module: torch.nn.Module, files: list[Path], prefix: str) -> int:
    """Copy every ``prefix``-named tensor of ``files`` into ``module`` (by name, without the
    prefix); a tensor missing, unexpected or of another shape is an error. Returns the count."""
    from safetensors import safe_open

    expected = module.state_dict()
    found: set[str] = set()
    with torch.no_grad():
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (OSError, RuntimeError) as exc:
                raise ModelError(f"cannot read {path}: {exc}") from exc
            with handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if not key.startswith(prefix):
                        continue
                    name = key[len(prefix) :]
                    if name not in expected:
                        raise ModelError(f"{path.name}: unexpected tensor {key!r} for this configuration")
                    tensor = handle.get_tensor(key)
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        raise ModelError(
                            f"{path.name}: {key!r} has shape {tuple(tensor.shape)}, the configuration needs "
                            f"{tuple(expected[name].shape)}"
                        )
                    expected[name].copy_(tensor)
                    found.add(name)
    missing = sorted(set(expected) - found)
    if missing:
        raise ModelError(
            f"the checkpoint lacks {len(missing)} {prefix}* tensors, e.g. {prefix}{missing[0]!r}"
        )
    return len(found)


class TTSCheckpoint:
    """One opened source of Qwen3-TTS models (see the module docstring)."""

    def __init__(
        self,
        config: TTSConfig,
        codec_config: CodecConfig,
        *,
        directory: Path | None,
        load_format: str,
        device: torch.device,
        dtype: str = "auto",
        seed: int = 0,
        generation: GenerationDefaults | None = None,
        is_tiny: bool = False,
    ) -> None:
        self.config = config
        self.codec_config = codec_config
        self.directory = directory
        self.load_format = load_format
        self.device = device
        self.seed = seed
        self.generation = generation or GenerationDefaults()
        self.is_tiny = is_tiny
        self.dtype = self._resolve_dtype(dtype)
        #: what the last build took (for the stage's startup report)
        self.build_seconds = 0.0

    @classmethod
    def open(cls, args: TTSModelArgs) -> TTSCheckpoint:
        device = args.torch_device()
        if args.is_tiny:
            from omnirelay.models.qwen3_tts.tiny import tiny_codec_config, tiny_tts_config

            return cls(
                TTSConfig.from_dict(tiny_tts_config(args.model)),
                CodecConfig.from_dict(tiny_codec_config()),
                directory=None,
                load_format="dummy",
                device=device,
                dtype=args.dtype,
                seed=args.seed,
                is_tiny=True,
            )
        if args.model_dir is None:
            return cls(
                TTSConfig.from_dict(_read_json(_CONFIGS / SHIPPED_MODELS[args.model])),
                CodecConfig.from_dict(_read_json(_CONFIGS / SHIPPED_CODEC)),
                directory=None,
                load_format="dummy",
                device=device,
                dtype=args.dtype,
                seed=args.seed,
            )
        return cls.open_dir(
            args.model_dir, load_format=args.load_format, device=device, dtype=args.dtype, seed=args.seed
        )

    @classmethod
    def open_dir(
        cls,
        path: str | Path,
        *,
        load_format: str = "auto",
        device: torch.device | None = None,
        dtype: str = "auto",
        seed: int = 0,
    ) -> TTSCheckpoint:
        directory = resolve_checkpoint(path, prefer_cache=True)
        if not directory.is_dir():
            raise ModelError(
                f"the Qwen3-TTS checkpoint directory {directory} does not exist; pass a local checkpoint "
                "directory or a Hugging Face repo id (owner/name)"
            )
        config = TTSConfig.from_dict(_read_json(directory / "config.json"))
        codec = CodecConfig.from_dict(_read_json(directory / "speech_tokenizer" / "config.json"))
        generation_path = directory / "generation_config.json"
        generation = (
            GenerationDefaults.from_dict(_read_json(generation_path)) if generation_path.is_file() else None
        )
        checkpoint = cls(
            config,
            codec,
            directory=directory,
            load_format=load_format,
            device=device or torch.device("cpu"),
            dtype=dtype,
            seed=seed,
            generation=generation,
        )
        if load_format == "auto":
            _weight_files(directory)
            if not (directory / "speech_tokenizer" / "model.safetensors").is_file():
                raise ModelError(f"{directory}/speech_tokenizer has no model.safetensors")
        return checkpoint

    def _resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype != "auto":
            return _DTYPES[dtype]
        declared = self.config.torch_dtype
        if self.is_tiny or declared not in _DTYPES:
            return torch.float32
        chosen = _DTYPES[declared]
        if self.device.type == "cpu" and chosen != torch.float32:
            return torch.float32  # half precision on a CPU is slow and rounds the decoder coarsely
        return chosen

    # ----------------------------------------------------------------- models

    def _build(self, module: torch.nn.Module, prefix: str, files: list[Path] | None) -> None:
        start = time.monotonic()
        module.to(self.dtype)
        if files is None:
            fill_seeded(
                module.state_dict(keep_vars=True), self.seed, prefix=prefix, on_device=not self.is_tiny
            )
        else:
            load_weights(module, files, prefix)
        module.eval()
        module.requires_grad_(False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.build_seconds = time.monotonic() - start

    def load_talker(self) -> TTSTalker:
        """The Talker with its code predictor, on the device, eval mode."""
        try:
            with self.device:
                talker = TTSTalker(self.config.talker_config)
        except torch.OutOfMemoryError as exc:
            raise ModelError(f"the Qwen3-TTS Talker does not fit on {self.device}: {exc}") from exc
        files = (
            None if self.load_format != "auto" or self.directory is None else _weight_files(self.directory)
        )
        self._build(talker, "talker.", files)
        return talker

    def load_codec(self) -> TTSCodec:
        """The 12 Hz tokenizer's decoder, on the device, eval mode."""
        try:
            with self.device:
                codec = TTSCodec(self.codec_config)
        except torch.OutOfMemoryError as exc:
            raise ModelError(f"the Qwen3-TTS decoder does not fit on {self.device}: {exc}") from exc
        files = None
        if self.load_format == "auto" and self.directory is not None:
            files = [self.directory / "speech_tokenizer" / "model.safetensors"]
        self._build(codec, "decoder.", files)
        if files is None:
            from omnirelay.models.qwen3_tts.tiny import scale_codec_output

            scale_codec_output(codec, seed=self.seed)  # audible noise, not 1e-2
        return codec

    def load_tokenizer(self) -> Any:
        """The checkpoint's Qwen tokenizer, or a byte-level one with the config's special ids."""
        from omnirelay.models.hf import dummy_tokenizer

        directory = self.directory
        if directory is not None and any((directory / name).is_file() for name in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load the tokenizer of {directory}: {exc}") from exc
        if self.is_tiny:
            from omnirelay.models.qwen3_tts.tiny import tiny_tokenizer

            return tiny_tokenizer()
        c = self.config
        ids = {
            "im_start_token_id": c.im_start_token_id,
            "im_end_token_id": c.im_end_token_id,
            "tts_bos_token_id": c.tts_bos_token_id,
            "tts_eos_token_id": c.tts_eos_token_id,
            "tts_pad_token_id": c.tts_pad_token_id,
        }
        if c.assistant_token_id is not None:
            ids["assistant_token_id"] = c.assistant_token_id
        return dummy_tokenizer(ids)


def check_checkpoint(path: str, load_format: str) -> None:
    """Open ``path`` as a Qwen3-TTS checkpoint (``--model``), or raise a ModelError saying why."""
    TTSCheckpoint.open_dir(path, load_format=load_format)
