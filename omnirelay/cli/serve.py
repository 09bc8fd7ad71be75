"""``omnirelay serve``: the OpenAI-compatible server over a pipeline's worker processes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from omnirelay.serving.config import ServerConfig

DEFAULT_PIPELINE = "qwen3-omni-tiny"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="the OpenAI-compatible HTTP/WebSocket server",
        description=(
            "Start one worker process per stage of the pipeline and serve it: POST /v1/chat/completions "
            "(text and audio, streaming or not), POST /v1/audio/speech, WS /v1/audio/speech/stream, "
            "GET /v1/models, /health and /metrics. Ctrl-C stops the server and every worker."
        ),
    )
    p.add_argument(
        "--pipeline",
        default=DEFAULT_PIPELINE,
        help=f"a shipped pipeline name or a YAML path (default {DEFAULT_PIPELINE})",
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
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from omnirelay.api import Pipeline
    from omnirelay.serving import create_app
    from omnirelay.serving.server import serve_forever

    config = ServerConfig(
        model_name=args.model_name, max_concurrency=args.max_concurrency, max_live_bytes=args.max_live_bytes
    )
    from omnirelay.cli.session import load_run_config

    if args.device is None and args.load_format is None:
        spec: Any = args.pipeline
    else:
        spec = load_run_config(args.pipeline, device=args.device, load_format=args.load_format)
    print(f"omnirelay serve: starting pipeline {args.pipeline!r} ...", file=sys.stderr, flush=True)
    pipeline = Pipeline.start(spec)
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
