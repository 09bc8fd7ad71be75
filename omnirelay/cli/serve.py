"""``omnirelay serve``: the OpenAI-compatible server over a pipeline's worker processes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omnirelay.cli.run import add_model_arguments
from omnirelay.cli.session import DEFAULT_MODEL_PIPELINE

if TYPE_CHECKING:
    from omnirelay.pipeline import PipelineConfig
    from omnirelay.serving.server_config import ServerConfig

#: SmolLM2 -> Piper voice -> PocketSphinx aligner: chat with audio, speech, word timestamps.
DEFAULT_PIPELINE = "voice-cpu"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="the OpenAI-compatible HTTP/WebSocket server",
        description=(
            "Start one worker process per stage of the pipeline and serve it: POST /v1/chat/completions "
            "(text and audio, streaming or not), POST /v1/audio/speech, WS /v1/audio/speech/stream "
            "(with word timestamps when the pipeline has an aligner), WS /v1/realtime (OpenAI's Realtime "
            "API: server VAD, barge-in), GET /v1/models, /health and "
            f"/metrics (OpenAPI schema: /openapi.json). The default pipeline, {DEFAULT_PIPELINE}, answers with SmolLM2 and speaks with "
            "a Piper voice; speech requests are read verbatim. Ctrl-C stops the server and every worker."
        ),
    )
    p.add_argument(
        "--pipeline",
        default=None,
        help=f"a shipped pipeline name or a YAML path (default {DEFAULT_PIPELINE}, or "
        f"{DEFAULT_MODEL_PIPELINE} with --model or --load-format dummy; the protocol test bed: "
        "qwen3-omni-tiny)",
    )
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument(
        "--model-name", default=None, help="the model name clients pass (default: the pipeline's name)"
    )
    _add_limit_flags(p)
    p.add_argument(
        "--ui",
        action="store_true",
        help="serve a browser page at / that records the microphone, talks to WS /v1/realtime and plays "
        "the answer (browsers give the microphone to localhost or HTTPS pages only; default: off)",
    )
    p.add_argument(
        "--local-cluster",
        action="store_true",
        help="for a pipeline placed on Ray: serve it on a two-node Ray cluster started on this machine "
        "(hostA, hostB; UCX over TCP), as omnirelay run --local-cluster does",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_security_flags(p)
    p.set_defaults(func=run_serve)


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """What the server takes at once: requests, sockets, bytes, input audio and images,
    restarts and audio streams."""
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="requests served at once, each response a WebSocket asks for included; more get 429 "
        "(default 64)",
    )
    p.add_argument(
        "--max-websockets",
        type=int,
        default=None,
        metavar="N",
        help="WebSocket connections open at once (/v1/audio/speech/stream and /v1/realtime together), each "
        "held for the connection's life; one more gets an error message (server_busy) and close 1013 "
        "(try again later). A pool of its own: an open socket holds no request slot, each response it "
        "asks for takes one as any request does (default: --max-concurrency)",
    )
    p.add_argument(
        "--max-live-bytes",
        type=int,
        default=None,
        help="429 while the pipeline holds more unconsumed transfer bytes than this (default: no limit)",
    )
    p.add_argument(
        "--max-audio-input-s",
        type=float,
        default=60.0,
        metavar="S",
        help="chat input_audio: the longest audio a request may carry, all parts together, in "
        "seconds decoded; longer is a 400 naming the limit (default 60)",
    )
    p.add_argument(
        "--max-audio-input-bytes",
        type=int,
        default=2 * 1024 * 1024,
        metavar="N",
        help="chat input_audio: the most encoded audio bytes a request may carry, all parts "
        "together (default 2 MiB; the 4 MiB body limit holds about 3 MiB of base64 audio)",
    )
    p.add_argument(
        "--max-image-input-bytes",
        type=int,
        default=2 * 1024 * 1024,
        metavar="N",
        help="chat image_url: the most encoded image bytes a request may carry, all parts together "
        "(default 2 MiB); images come inline as data: URLs only (remote URLs are refused)",
    )
    p.add_argument(
        "--max-image-input-pixels",
        type=int,
        default=4096 * 4096,
        metavar="N",
        help="chat image_url: the most pixels (width x height) of one image; larger is a 400 naming "
        "the limit, smaller ones are scaled to the model's own pixel range (default 16777216)",
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
    p.add_argument(
        "--max-audio-streams",
        type=int,
        default=None,
        metavar="N",
        help="the pipeline's real-time capacity: audio streams served at once; one more (or any new "
        "one while an admitted stream is running dry) gets 429 with Retry-After (default: the "
        "pipeline file's max_audio_streams, else no fixed limit)",
    )


#: Environment variable with API keys (comma-separated), used when no --api-key is given.
API_KEY_ENV = "OMNIRELAY_API_KEY"


def _add_security_flags(p: Any) -> None:
    g = p.add_argument_group(
        "security",
        "With API keys, every /v1 route and the WebSocket need 'Authorization: Bearer KEY' (the "
        "WebSocket also takes ?api_key=KEY), else 401; /health and /metrics stay open unless "
        "protected. Requests from a browser (with an Origin header) are refused with 403 unless the "
        "origin is this server's own host or listed in --allowed-origins; listed origins get CORS "
        "headers. A loopback server answers only to loopback Host names (--allowed-hosts). JSON routes "
        "take only Content-Type: application/json (415 otherwise).",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"a key clients must present (repeat for several; default: ${API_KEY_ENV}, "
        "comma-separated: better, as a command line is visible to other users; none: no "
        "authentication). Keys are never printed or logged",
    )
    g.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGINS",
        help="browser origins allowed besides the server's own host, comma-separated or repeated "
        "(scheme://host[:port], e.g. https://app.example.com; * for any); default: none",
    )
    g.add_argument(
        "--allowed-hosts",
        action="append",
        default=None,
        metavar="HOSTS",
        help="Host header values the server answers, comma-separated or repeated (names or "
        "addresses without port; * for any); others get 400. Default: for a loopback --host, "
        "localhost, 127.0.0.1 and ::1 (this defeats DNS rebinding from a web page); else any",
    )
    g.add_argument(
        "--protect-health", action="store_true", help="require the API key on /health too (default: open)"
    )
    g.add_argument(
        "--protect-metrics", action="store_true", help="require the API key on /metrics too (default: open)"
    )


def security_limits(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The ServerConfig fields of the security flags (``environ`` supplies the keys when no
    --api-key is given); warns on stderr when a non-loopback address has no key."""
    from omnirelay.serving.security import is_loopback_host

    given = args.api_key if args.api_key is not None else [environ.get(API_KEY_ENV, "")]
    keys = tuple(k.strip() for v in given for k in v.split(",") if k.strip())
    origins = tuple(o.strip() for v in args.allowed_origins or () for o in v.split(",") if o.strip())
    if not keys and not is_loopback_host(args.host):
        print(
            f"omnirelay serve: WARNING: binding {args.host}, reachable from other machines, without an API "
            f"key: anyone who can reach it can use it. Pass --api-key KEY (or set {API_KEY_ENV}).",
            file=sys.stderr,
            flush=True,
        )
    hosts = tuple(h.strip() for v in args.allowed_hosts or () for h in v.split(",") if h.strip())
    if not hosts:
        hosts = _default_allowed_hosts(args.host)
    return {
        "api_keys": keys,
        "allowed_origins": origins,
        "allowed_hosts": hosts,
        "protect_health": args.protect_health,
        "protect_metrics": args.protect_metrics,
    }


def _default_allowed_hosts(bind: str) -> tuple[str, ...]:
    """Loopback names for a loopback address (and the address itself); any otherwise."""
    from omnirelay.serving.security import is_loopback_host

    if not is_loopback_host(bind):
        return ("*",)
    names = ["localhost", "127.0.0.1", "::1"]
    if bind.strip("[]").lower() not in names:
        names.append(bind.strip("[]"))
    return tuple(names)


def server_config(pipeline: PipelineConfig, **limits: Any) -> ServerConfig:
    """The server's config for ``pipeline``: ``limits`` (model name, concurrency …), the
    voices it speaks with (a Piper voice stage names its own, a Qwen3-TTS Talker its
    speakers; otherwise the Qwen3-Omni speakers) and its audio rate (the Piper voice's;
    otherwise Code2Wav's 24 kHz)."""
    from omnirelay.models import stage_voice
    from omnirelay.serving.server_config import ServerConfig, openai_voice_map

    config = ServerConfig(**limits)
    voice = stage_voice(pipeline)
    if voice is not None:
        config = ServerConfig(
            voices=voice.voices or (voice.name,),
            default_voice=voice.name,
            sample_rate=voice.sample_rate,
            **limits,
        )
    openai_voice_map(pipeline.openai_voices, config.voices, pipeline.source)  # before any stage starts
    return config


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


def with_max_audio_streams(pipeline: PipelineConfig, max_streams: int) -> PipelineConfig:
    """The pipeline with ``--max-audio-streams`` over its file's ``max_audio_streams``."""
    import msgspec

    from omnirelay.errors import ConfigError

    if isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1:
        raise ConfigError(f"--max-audio-streams must be an int >= 1, got {max_streams!r}")
    return msgspec.structs.replace(pipeline, max_audio_streams=max_streams)


def run_serve(args: argparse.Namespace) -> int:
    from omnirelay.cli.doctor import check_multihost
    from omnirelay.cli.session import load_run_config
    from omnirelay.pipeline import load_pipeline
    from omnirelay.pipeline.reproducible import with_reproducible

    local = bool(getattr(args, "local_cluster", False))
    if args.model is None and args.device is None and args.load_format is None and args.runner is None:
        # The file alone: no model family is imported (torch would take seconds) before
        # the port is bound and /health answers.
        pipeline = load_pipeline(args.pipeline or DEFAULT_PIPELINE)
    else:  # the checkpoint is opened now: a wrong one fails before the port is taken
        pipeline = load_run_config(
            args.pipeline,
            model=args.model,
            device=args.device,
            load_format=args.load_format,
            runner=args.runner,
        )
    if args.device_groups is not None:
        pipeline = pipeline.with_device_groups(args.device_groups)
    if args.reproducible:
        pipeline = with_reproducible(pipeline)
    # Ray and NIXL, where the pipeline needs them, before a cluster, the port or a stage.
    check_multihost(pipeline, local_cluster=local)
    if not local:
        return _serve(args, pipeline)
    from omnirelay.api import local_cluster

    print(
        "omnirelay serve: starting a local two-node Ray cluster (hostA, hostB)", file=sys.stderr, flush=True
    )
    with local_cluster() as address:
        os.environ["RAY_ADDRESS"] = address
        return _serve(args, pipeline)


def _serve(args: argparse.Namespace, pipeline_config: PipelineConfig) -> int:
    from omnirelay.serving.server import bind_socket
    from omnirelay.serving.server_config import ServerConfig

    if args.max_restarts is not None:
        pipeline_config = with_max_restarts(pipeline_config, args.max_restarts)
    if args.max_audio_streams is not None:
        pipeline_config = with_max_audio_streams(pipeline_config, args.max_audio_streams)
    security = security_limits(args, os.environ)
    door = ServerConfig(**security)  # the front door's settings: known before anything loads
    # The port first: a port the server cannot have fails now, not after the stages load.
    sock = bind_socket(args.host, args.port)
    try:
        return _serve_while_starting(args, pipeline_config, door, sock)
    finally:
        sock.close()


def _limits(args: argparse.Namespace, door: ServerConfig) -> dict[str, Any]:
    """The ServerConfig fields of the flags (the security ones from ``door``)."""
    return {
        "model_name": args.model_name,
        "max_concurrency": args.max_concurrency,
        "max_websockets": args.max_websockets,
        "max_live_bytes": args.max_live_bytes,
        "max_audio_input_s": args.max_audio_input_s,
        "max_audio_input_bytes": args.max_audio_input_bytes,
        "max_image_input_bytes": args.max_image_input_bytes,
        "max_image_input_pixels": args.max_image_input_pixels,
        "ui": args.ui,
        "api_keys": door.api_keys,
        "allowed_origins": door.allowed_origins,
        "allowed_hosts": door.allowed_hosts,
        "protect_health": door.protect_health,
        "protect_metrics": door.protect_metrics,
    }


def _serve_while_starting(
    args: argparse.Namespace, pipeline_config: PipelineConfig, door: ServerConfig, sock: Any
) -> int:
    """Serve on ``sock`` at once: ``/health`` says ``starting`` (each stage's progress)
    while another thread prepares the models and starts the pipeline, then the real app
    takes every request. A start that fails stops the server and raises; SIGTERM or
    Ctrl-C meanwhile waits for the start to end, then stops the stages it started."""
    import threading

    from omnirelay.serving.security import SecurityMiddleware
    from omnirelay.serving.server import serve_forever
    from omnirelay.serving.startup import LateApp, StartupBoard

    board = StartupBoard(pipeline_config)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    started: list[Any] = []
    failures: list[BaseException] = []
    servers: list[Any] = []

    def start() -> None:
        try:
            from omnirelay.api import Pipeline
            from omnirelay.models import prepare_models
            from omnirelay.serving import create_app

            config = server_config(pipeline_config, **_limits(args, door))
            prepare_models(pipeline_config.stages, lambda label, done="ready": _Step(board, label, done))
            board.step(f"starting {pipeline_config.num_workers} stage processes")
            print(
                f"omnirelay serve: starting pipeline {pipeline_config.name!r} ...",
                file=sys.stderr,
                flush=True,
            )
            pipeline = Pipeline.start(pipeline_config, on_stage_ready=board.stage_ready)
            started.append(pipeline)
            late.ready(create_app(pipeline, config))
            print(
                f"omnirelay serve: {pipeline.config.name} on {url} "
                f"({pipeline.config.num_workers} stage workers, namespace {pipeline.namespace})"
                + (f"; the browser page: {url}/" if args.ui else ""),
                file=sys.stderr,
                flush=True,
            )
        except BaseException as exc:
            failures.append(exc)
            board.fail(str(exc))
            for server in servers:
                server.should_exit = True

    thread = threading.Thread(target=start, name="omnirelay-serve-start", daemon=True)
    late = LateApp(board, on_startup=thread.start)
    sock.listen(128)  # clients wait in the backlog, not refused, while the server comes up
    print(f"omnirelay serve: listening on {url} (/health shows the start)", file=sys.stderr, flush=True)
    try:
        serve_forever(
            SecurityMiddleware(late, door),
            args.host,
            args.port,
            log_level=args.log_level,
            sock=sock,
            on_server=servers.append,
        )
    finally:
        if thread.is_alive() or thread.ident is not None:
            thread.join()
        for pipeline in started:
            pipeline.shutdown()
    if failures:
        raise failures[0]
    return 0


class _Step:
    """One step of the start: on the startup board (``/health``) and on stderr."""

    def __init__(self, board: Any, label: str, done: str) -> None:
        from omnirelay.cli.session import Progress

        self._board = board
        self._label = label
        self._progress = Progress(label, sys.stderr, done=done)

    def __enter__(self) -> _Step:
        self._board.step(self._label)
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)
