"""Fuzz the server's front door (``python -m benchmarks.fuzz_serve``).

1. **HTTP**: Schemathesis reads the server's own ``/openapi.json`` and generates requests
   for every ``/v1`` operation, schema-conforming (positive) and schema-violating
   (negative), ``--examples`` of each per operation. Every answer must come within the
   timeout, be below 500, and an error must be OpenAI's JSON error body.
2. **WebSocket**: ``--ws-frames`` connections to ``/v1/audio/speech/stream``, each sending
   one malformed frame (random bytes, text that is not JSON, JSON that is not an object,
   nesting far too deep, over the size limit, a missing or unknown ``type``, fields of
   the wrong JSON type, an unpaired surrogate escape), some after a valid
   ``session.config``. Each must get exactly one ``error`` frame, then a 1008 close.
3. The server must still be healthy after both: ``/health`` is 200 and a chat request is
   answered; the pipeline holds no request state and no transfer object.

Usage, from a checkout's root: ``python -m benchmarks.fuzz_serve [--pipeline toy-3stage]
[--examples 200] [--ws-frames 2000] [--seed 0] [--json PATH]``. Exit status 0 when every
check passed. The suite runs a reduced version (``tests/test_serving_fuzz.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import websockets

__all__ = ["HttpReport", "WsReport", "fuzz_http", "fuzz_ws", "malformed_frames"]

API_KEY = "sk-fuzz"
#: a request slower than this counts as a hang
TIMEOUT_S = 30.0


@dataclass
class HttpReport:
    examples_per_operation: int
    operations: list[str] = field(default_factory=list)
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0
    hangs: int = 0
    bad_error_bodies: int = 0
    schema_errors: int = 0
    skipped: list[str] = field(default_factory=list)  # nothing to generate (no negative case)
    failures: list[str] = field(default_factory=list)  # the first few, to reproduce

    @property
    def ok(self) -> bool:
        return not (self.server_errors or self.hangs or self.bad_error_bodies or self.schema_errors)


def fuzz_http(base_url: str, *, examples: int, api_key: str | None = API_KEY, seed: int = 0) -> HttpReport:
    """Generate ``examples`` positive and ``examples`` negative cases for every /v1
    operation of ``base_url``'s OpenAPI schema and send them (see the module docstring).
    An operation with nothing to violate (no parameters, no body) has no negative cases."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.core.result import Ok

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    report = HttpReport(examples_per_operation=examples)
    statuses: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            report.schema_errors += 1
            _note(report, f"the schema has an invalid operation: {result.err()}"[:300])
            continue
        operation = result.ok()
        if not operation.path.startswith("/v1"):
            continue
        report.operations.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = _sender(
                report, statuses, base_url, headers, mode.value, operation.as_strategy(generation_mode=mode)
            )
            try:
                run(examples, seed)
            except Unsatisfiable:
                report.skipped.append(f"{mode.value} {operation.label}")
    report.statuses = dict(sorted(statuses.items()))
    return report


def _sender(
    report: HttpReport,
    statuses: Counter[str],
    base_url: str,
    headers: dict[str, str],
    mode: str,
    strategy: Any,
) -> Any:
    """A function that draws ``examples`` cases from ``strategy`` and sends each."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    def send(case: Any) -> None:
        report.requests += 1
        label = f"{mode} {case.method} {case.formatted_path}"
        try:
            resp = case.call(base_url=base_url, headers=headers, timeout=TIMEOUT_S)
        except Exception as exc:  # a timeout or a dropped connection: both are failures
            report.hangs += 1
            _note(report, f"{label}: {type(exc).__name__}: {exc}"[:300])
            return
        statuses[str(resp.status_code)] += 1
        if resp.status_code >= 500:
            report.server_errors += 1
            _note(report, f"{label}: {resp.status_code} {resp.text[:200]} <- {str(case.body)[:200]}")
        elif resp.status_code >= 400 and not _is_error_body(resp):
            report.bad_error_bodies += 1
            _note(report, f"{label}: {resp.status_code} not an error body: {resp.text[:200]}")

    def run(examples: int, seed: int) -> None:
        test = given(case=strategy)(send)
        test = settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(test)
        hseed(seed)(test)()

    return run


def _is_error_body(resp: Any) -> bool:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("code"), str)
    )


def _note(report: HttpReport | WsReport, failure: str) -> None:
    if len(report.failures) < 10:
        report.failures.append(failure)


# ------------------------------------------------------------------- WebSocket


@dataclass
class WsReport:
    frames: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    error_then_1008: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error_then_1008 == self.frames


_CONFIG = json.dumps({"type": "session.config"})
_TYPES = ("session.config", "input.text", "input.done", "session.close")


def malformed_frames(rng: random.Random, n: int, max_bytes: int) -> list[tuple[str, list[str | bytes]]]:
    """``n`` ``(kind, frames)``: every last frame is malformed; some follow a valid config."""

    def junk_json() -> Any:
        return rng.choice([None, True, 3, -1.5, "x" * rng.randint(0, 40), [], [1, "a"], {"a": [1]}])

    makers: dict[str, Callable[[], str | bytes]] = {
        "random bytes": lambda: rng.randbytes(rng.randint(0, 512)),
        "random text": lambda: "".join(
            chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 200))
        ).replace("{", "("),
        "json not an object": lambda: json.dumps(junk_json() if rng.random() < 0.5 else [junk_json()]),
        "deep": lambda: "[" * (depth := rng.randint(65, 20_000)) + "]" * depth,
        "deep inside": lambda: '{"type": "session.config", "v": ' + "{" * 100 + "}" * 100 + "}",
        "huge": lambda: json.dumps({"type": "input.text", "text": "x" * (max_bytes + rng.randint(1, 4096))}),
        "no type": lambda: json.dumps({"text": "hi", "voice": junk_json()}),
        "type not a string": lambda: json.dumps({"type": junk_json() if rng.random() < 0.5 else 7}),
        "unknown type": lambda: json.dumps(
            {"type": rng.choice(["", "input", "SESSION.CONFIG", "audio.start"])}
        ),
        "wrong field type": lambda: json.dumps(
            rng.choice(
                [
                    {"type": "session.config", "voice": rng.choice([1, [], {}, True])},
                    {"type": "session.config", "stream_audio": rng.choice(["yes", 1, []])},
                    {"type": "session.config", "split": rng.choice([0, ["none"]])},
                    {"type": "input.text", "text": rng.choice([None, 5, ["a"], {"t": 1}])},
                ]
            )
        ),
        "lone surrogate": lambda: (
            '{"type": "input.text", "text": "a\\u' + rng.choice(["d800", "DBFF", "dc00"]) + '"}'
        ),
        "truncated json": lambda: json.dumps({"type": rng.choice(_TYPES), "text": "abc"})[
            : rng.randint(1, 20)
        ],
    }
    kinds = list(makers)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        frame: str | bytes = makers[kind]()
        frames: list[str | bytes] = [_CONFIG, frame] if rng.random() < 0.5 else [frame]
        if kind in ("wrong field type", "lone surrogate") and '"input.text"' in str(frame):
            frames = [_CONFIG, frame]  # without a config first it would be config_required
        out.append((kind, frames))
    return out


async def fuzz_ws(
    ws_url: str,
    *,
    frames: int,
    max_bytes: int,
    api_key: str | None = API_KEY,
    seed: int = 0,
    concurrency: int = 8,
) -> WsReport:
    """Send each of :func:`malformed_frames` on its own connection; each must get one
    ``error`` frame and a 1008 close."""
    rng = random.Random(seed)
    cases = malformed_frames(rng, frames, max_bytes)
    report = WsReport(frames=len(cases), kinds=dict(Counter(k for k, _ in cases)))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)

    async def one(kind: str, sent: list[str | bytes]) -> None:
        async with gate:
            try:
                got, code = await asyncio.wait_for(_exchange(ws_url, sent, headers), TIMEOUT_S)
            except Exception as exc:
                _note(report, f"{kind}: {type(exc).__name__}: {exc}"[:300])
                return
        errors = [m for m in got if isinstance(m, str) and json.loads(m).get("type") == "error"]
        if code == 1008 and len(errors) == 1 and len(got) == 1:
            report.error_then_1008 += 1
        else:
            _note(report, f"{kind}: close {code}, got {[str(m)[:80] for m in got]}, sent {str(sent)[:120]}")

    await asyncio.gather(*(one(kind, sent) for kind, sent in cases))
    return report


async def _exchange(
    url: str, frames: list[str | bytes], headers: dict[str, str]
) -> tuple[list[Any], int | None]:
    got: list[Any] = []
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        for frame in frames:
            await ws.send(frame)
        try:
            async for message in ws:
                got.append(message)
        except websockets.ConnectionClosedError:
            pass
        return got, ws.close_code


def check_healthy(base_url: str, model: str, api_key: str | None = API_KEY) -> str | None:
    """None when /health is 200 and a chat request is answered; else what is wrong."""
    health = httpx.get(base_url + "/health", timeout=TIMEOUT_S)
    if health.status_code != 200:
        return f"/health answered {health.status_code}: {health.text[:200]}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    chat = httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT_S)
    if chat.status_code != 200:
        return f"a chat request after the fuzz answered {chat.status_code}: {chat.text[:200]}"
    return None


# ------------------------------------------------------------------- the script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fuzz_serve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pipeline", default="toy-3stage", help="the pipeline to serve (default toy-3stage)")
    parser.add_argument(
        "--examples", type=int, default=200, help="examples per operation and mode (default 200)"
    )
    parser.add_argument(
        "--ws-frames", type=int, default=2000, help="malformed WebSocket frames (default 2000)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)

    from omnirelay.api import Pipeline
    from omnirelay.connectors.shm import sweep
    from omnirelay.serving import ServerConfig, ServerThread, create_app

    config = ServerConfig(
        api_keys=(API_KEY,),
        max_tokens_limit=64,
        max_body_bytes=256 * 1024,
        ws_max_config_bytes=64 * 1024,
        ws_max_text_bytes=16 * 1024,
    )
    t0 = time.monotonic()
    with Pipeline.start(args.pipeline) as pipe:
        app = create_app(pipe, config)
        with ServerThread(app) as server:
            model = app.state.frontend.model_name
            http = fuzz_http(server.base_url, examples=args.examples, seed=args.seed)
            ws_url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
            ws = asyncio.run(
                fuzz_ws(ws_url, frames=args.ws_frames, max_bytes=config.ws_max_config_bytes, seed=args.seed)
            )
            unhealthy = check_healthy(server.base_url, model)
            deadline = time.monotonic() + 30
            while (
                app.state.frontend.admission.num_active or pipe.num_active
            ) and time.monotonic() < deadline:
                time.sleep(0.05)
            leftover: dict[str, Any] = {
                "server_in_flight": app.state.frontend.admission.num_active,
                "pipeline_in_flight": pipe.num_active,
                "request_state": pipe.leaks(),
            }
    leftover["objects_after_shutdown"] = len(sweep(pipe.namespace).objects)
    report = {
        "pipeline": args.pipeline,
        "seed": args.seed,
        "http": {**asdict(http), "ok": http.ok},
        "ws": {**asdict(ws), "ok": ws.ok},
        "healthy_after": unhealthy is None,
        "unhealthy": unhealthy,
        "leftover": leftover,
        "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    passed = http.ok and ws.ok and unhealthy is None and not any(leftover.values())
    print("fuzz_serve:", "PASS" if passed else "FAIL", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
