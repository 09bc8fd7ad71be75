"""``omnirelay serve``: the OpenAI-compatible server over a pipeline's worker processes."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirelay.pipeline import PipelineConfig
    from omnirelay.serving.config import ServerConfig

#: SmolLM2 -> Piper voice -> PocketSphinx aligner: chat with audio, speech, word timestamps.
DEFAULT_PIPELINE = "voice-cpu"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="the OpenAI-compatible HTTP/WebSocket server",
        description=(
            "Start one worker process per stage of the pipeline and serve it: POST /v1/chat/completions "
            "(text and audio, streaming or not), POST /v1/audio/speech, WS /v1/audio/speech/stream "
            "(with word timestamps when the pipeline has an aligner), GET /v1/models, /health and "
            f"/metrics. The default pipeline, {DEFAULT_PIPELINE}, answers with SmolLM2 and speaks with "
            "a Piper voice; speech requests are read verbatim. Ctrl-C stops the server and every worker."
        ),
    )
    p.add_argument(
        "--pipeline",
        default=DEFAULT_PIPELINE,
        help=f"a shipped pipeline name or a YAML path (default {DEFAULT_PIPELINE}; the protocol test "
        "bed: qwen3-omni-tiny)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="run every Qwen3-Omni stage on this torch device (cpu, cuda:0); default: the pipeline file's",
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: random weights from the config alone (no checkpoint; the shipped full-size config)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument(
        "--model-name", default=None, help="the model name clients pass (default: the pipeline's name)"
    )
    p.add_argument(
        "--max-concurrency", type=int, default=64, help="requests served at once; more get 429 (default 64)"
    )
    p.add_argument(
        "--max-live-bytes",
        type=int,
        default=None,
        help="429 while the pipeline holds more unconsumed transfer bytes than this (default: no limit)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart a stage worker that dies at most N times within the restart window, with "
        "exponential backoff; then /health reports it failed (default: the pipeline file's "
        "'restart:' mapping, else 5 in 300 s; 0: never restart)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def server_config(pipeline: PipelineConfig, **limits: Any) -> ServerConfig:
    """The server's config for ``pipeline``: ``limits`` (model name, concurrency …) and the
    voices it speaks with (a Piper voice stage names its own; otherwise the Qwen speakers)."""
    from omnirelay.models import VOICE_EXECUTOR
    from omnirelay.models.piper import voice_alias
    from omnirelay.serving.config import ServerConfig

    for stage in pipeline.stages:
        if stage.executor == VOICE_EXECUTOR:
            alias = voice_alias(str(stage.executor_args.get("voice", "en_US-joe-medium")))
            return ServerConfig(voices=(alias,), default_voice=alias, **limits)
    return ServerConfig(**limits)


def with_max_restarts(pipeline: PipelineConfig, max_restarts: int) -> PipelineConfig:
    """The pipeline with ``--max-restarts`` over its file's restart policy (the other keys
    stay); a :class:`~omnirelay.errors.ConfigError` that names the flag when it is invalid."""
    import msgspec

    from omnirelay.errors import ConfigError

    try:
        policy = msgspec.structs.replace(pipeline.restart, max_restarts=max_restarts)
    except ConfigError as exc:
        raise ConfigError(f"--max-restarts {max_restarts}: {exc}") from exc
    return pipeline.with_restart(policy)


def run_serve(args: argparse.Namespace) -> int:
    from omnirelay.api import Pipeline
    from omnirelay.cli.session import Progress
    from omnirelay.models import prepare_stage_models
    from omnirelay.pipeline import load_pipeline
    from omnirelay.serving import create_app
    from omnirelay.serving.server import serve_forever

    if args.device is None and args.load_format is None:
        pipeline_config = load_pipeline(args.pipeline)
    else:
        from omnirelay.cli.session import load_run_config

        pipeline_config = load_run_config(args.pipeline, device=args.device, load_format=args.load_format)
    if args.max_restarts is not None:
        pipeline_config = with_max_restarts(pipeline_config, args.max_restarts)
    config = server_config(
        pipeline_config,
        model_name=args.model_name,
        max_concurrency=args.max_concurrency,
        max_live_bytes=args.max_live_bytes,
    )
    prepare_stage_models(pipeline_config.stages, lambda label: Progress(label, sys.stderr, done="ready"))
    print(f"omnirelay serve: starting pipeline {args.pipeline!r} ...", file=sys.stderr, flush=True)
    pipeline = Pipeline.start(pipeline_config)
    try:
        app = create_app(pipeline, config)
        print(
            f"omnirelay serve: {pipeline.config.name} on http://{args.host}:{args.port} "
            f"({pipeline.config.num_stages} stage workers, namespace {pipeline.namespace})",
            file=sys.stderr,
            flush=True,
        )
        serve_forever(app, args.host, args.port, log_level=args.log_level)
    finally:
        pipeline.shutdown()
    return 0
