"""SIGKILL each stage of a live server in turn under streaming load (``python -m benchmarks.supervise``).

For each stage (in order, ``--rounds`` times): ``--streams`` streaming chat requests with
audio are opened and read until each has its first audio; then the stage's worker (its
pid from ``/health``) is SIGKILLed. Measured per kill:

* **time to fail** — from the kill to each stream's end; every stream must end with an
  ``error`` event whose code is ``stage_unavailable`` (the target: under 2 s);
* **refused** — probe requests sent every ``--probe-interval`` while the stage is down:
  each must be a 503 ``stage_unavailable`` with ``Retry-After`` (anything else counts as
  wrong), never a hang;
* **restart** — from the kill to ``/health`` showing the stage ``healthy`` again with one
  more restart;
* **first success** — from the kill to the first probe answered 200 with audio.

At the end: the leftovers — requests the front or any stage engine still holds
(``/health``) and transfer objects of the server's namespace in /dev/shm.

Without ``--url`` the pipeline (``--pipeline``, default ``qwen3-omni-tiny``) and a server
on 127.0.0.1 are started here and stopped at the end; with ``--url`` the server must run
on this host (its stage processes are signalled). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.serve import check_loopback_url
from omnirelay.connectors.shm import sweep

DEFAULT_PIPELINE = "qwen3-omni-tiny"
FAIL_TARGET_S = 2.0


@dataclass
class KillResult:
    stage: int
    name: str
    fail_s: list[float] = field(default_factory=list)
    stream_errors: list[str | None] = field(default_factory=list)
    refused_503: int = 0
    refused_wrong: list[str] = field(default_factory=list)
    restart_s: float | None = None
    #: when the last /health poll that still saw the stage down was sent: no request can
    #: succeed before the server answered it (restart_s, seen by a poller 20 ms apart, can
    #: come after the probe's first success)
    last_down_s: float | None = None
    first_success_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "name": self.name,
            "fail_s_max": round(max(self.fail_s), 3) if self.fail_s else None,
            "fail_s_median": round(statistics.median(self.fail_s), 3) if self.fail_s else None,
            "stream_error_codes": self.stream_errors,
            "refused_503": self.refused_503,
            "refused_wrong": self.refused_wrong,
            "restart_s": None if self.restart_s is None else round(self.restart_s, 3),
            "last_down_s": None if self.last_down_s is None else round(self.last_down_s, 3),
            "first_success_s": None if self.first_success_s is None else round(self.first_success_s, 3),
        }


def chat_body(model: str | None, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Tell me a long story about the sea, please."}],
        "modalities": ["text", "audio"],
        "audio": {"format": "pcm16"},  # the server's default voice
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if model is not None:
        body["model"] = model
    return body


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], first_audio: asyncio.Event
) -> tuple[float, str | None]:
    """One streaming chat: set ``first_audio`` at its first audio delta; return when it
    ended and the ``error`` code it ended with (None: it ended without one)."""
    code: str | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            first_audio.set()
            return time.monotonic(), f"http {resp.status_code}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                code = event["error"].get("code") or "error"
            elif event.get("choices") and "audio" in event["choices"][0]["delta"]:
                first_audio.set()
    first_audio.set()
    return time.monotonic(), code


async def _probe(
    client: httpx.AsyncClient, body: dict[str, Any], result: KillResult, t_kill: float, interval_s: float
) -> None:
    """Probe requests until one succeeds with audio: 503s must say stage_unavailable."""
    while True:
        t_sent = time.monotonic()
        resp = await client.post("/v1/chat/completions", json=body)
        if resp.status_code == 200 and resp.json()["choices"][0]["message"].get("audio"):
            result.first_success_s = time.monotonic() - t_kill
            return
        if (
            resp.status_code == 503
            and resp.json()["error"]["code"] == "stage_unavailable"
            and resp.headers.get("Retry-After")
        ):
            result.refused_503 += 1
        else:
            result.refused_wrong.append(f"{resp.status_code}: {resp.text[:200]}")
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t_sent)))


async def kill_one(client: httpx.AsyncClient, stage_id: int, args: argparse.Namespace) -> KillResult:
    health = (await client.get("/health")).json()
    stage = health["stages"][stage_id]
    result = KillResult(stage_id, stage["name"])
    events = [asyncio.Event() for _ in range(args.streams)]
    body = chat_body(args.model, args.max_tokens, stream=True)
    streams = [asyncio.ensure_future(_stream(client, body, ev)) for ev in events]
    await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), args.timeout)
    t_kill = time.monotonic()
    os.kill(int(stage["pid"]), signal.SIGKILL)
    probe_body = chat_body(args.model, args.probe_tokens, stream=False)
    probe = asyncio.ensure_future(_probe(client, probe_body, result, t_kill, args.probe_interval))
    for ended, code in await asyncio.wait_for(asyncio.gather(*streams), args.timeout):
        result.fail_s.append(ended - t_kill)
        result.stream_errors.append(code)
    restarts = stage["restarts"]
    while True:
        t_sent = time.monotonic()
        st = (await client.get("/health")).json()["stages"][stage_id]
        if st["state"] == "healthy" and st["restarts"] > restarts:
            result.restart_s = time.monotonic() - t_kill
            break
        result.last_down_s = t_sent - t_kill
        if st["state"] == "failed" or time.monotonic() - t_kill > args.timeout:
            break
        await asyncio.sleep(0.02)
    await asyncio.wait_for(probe, args.timeout)
    return result


async def leftovers(client: httpx.AsyncClient) -> dict[str, Any]:
    """Requests still held anywhere, and transfer objects of the namespace."""
    deadline = time.monotonic() + 10
    while True:  # the last responses' releases are on their way: settle, bounded
        health = (await client.get("/health")).json()
        held = health["num_requests"] + sum(
            s["num_requests"] + (s["queue_depth"] or 0) for s in health["stages"]
        )
        objects = [o for o in sweep(health["namespace"]).objects if o.kind != "slot"]
        if (not held and not objects) or time.monotonic() > deadline:
            return {"requests_held": held, "transfer_objects": len(objects), "status": health["status"]}
        await asyncio.sleep(0.1)


async def supervise(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        num_stages = len((await client.get("/health")).json()["stages"])
        stage_ids = range(num_stages) if args.stages is None else args.stages
        kills = []
        for _ in range(args.rounds):
            for stage_id in stage_ids:
                kills.append(await kill_one(client, stage_id, args))
        return {"kills": [k.to_dict() for k in kills], **(await leftovers(client))}


def check(result: dict[str, Any]) -> list[str]:
    bad = []
    for k in result["kills"]:
        where = f"stage {k['stage']} ({k['name']})"
        if k["fail_s_max"] is None or k["fail_s_max"] > FAIL_TARGET_S:
            bad.append(f"{where}: streams took {k['fail_s_max']} s to fail (target {FAIL_TARGET_S} s)")
        if any(code != "stage_unavailable" for code in k["stream_error_codes"]):
            bad.append(f"{where}: streams ended with {k['stream_error_codes']}")
        if k["refused_wrong"]:
            bad.append(
                f"{where}: {len(k['refused_wrong'])} wrong answers while down: {k['refused_wrong'][:2]}"
            )
        if k["restart_s"] is None or k["first_success_s"] is None:
            bad.append(f"{where}: did not come back")
    if result["requests_held"] or result["transfer_objects"]:
        bad.append(f"left: {result['requests_held']} requests, {result['transfer_objects']} objects")
    return bad


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{'stage':<16} {'fail max s':>10} {'fail p50 s':>10} {'503s':>5} {'restart s':>9} {'1st ok s':>8}  stream ends"
    ]
    for k in result["kills"]:
        codes = ",".join(sorted({str(c) for c in k["stream_error_codes"]}))
        lines.append(
            f"{k['stage']} {k['name']:<14} {k['fail_s_max']!s:>10} {k['fail_s_median']!s:>10} "
            f"{k['refused_503']:>5} {k['restart_s']!s:>9} {k['first_success_s']!s:>8}  {codes}"
        )
    lines.append(
        f"left: {result['requests_held']} requests held, {result['transfer_objects']} transfer objects; "
        f"status {result['status']}"
    )
    return "\n".join(lines)


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """Start the pipeline and a server on 127.0.0.1 here; supervise; stop both."""
    from omnirelay.api import Pipeline, RestartPolicy
    from omnirelay.cli.serve import server_config
    from omnirelay.pipeline import load_pipeline
    from omnirelay.serving import ServerThread, create_app

    config = load_pipeline(args.pipeline)
    policy = RestartPolicy(
        max_restarts=10 * config.num_stages * args.rounds, backoff_s=0.1, max_backoff_s=1.0
    )
    pipe = Pipeline.start(config, restart=policy)
    try:
        app = create_app(pipe, server_config(config, max_tokens_limit=max(4096, args.max_tokens)))
        with ServerThread(app, host="127.0.0.1", port=0) as server:
            return asyncio.run(supervise(server.base_url, args))
    finally:
        report = pipe.shutdown()
        if report.num_objects_left:
            print(f"shutdown left {report.num_objects_left} objects", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.supervise", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server on this host (default: start one here)")
    p.add_argument("--pipeline", default=DEFAULT_PIPELINE, help=f"without --url (default {DEFAULT_PIPELINE})")
    p.add_argument("--model", default=None, help="the model name to send (default: none, the server's)")
    p.add_argument(
        "--streams", type=int, default=4, help="streaming requests in flight at each kill (default 4)"
    )
    p.add_argument("--rounds", type=int, default=1, help="times each stage is killed (default 1)")
    p.add_argument(
        "--stages",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="the stage ids to kill, comma-separated (default: every stage)",
    )
    p.add_argument("--max-tokens", type=int, default=1000, help="the streams' max_tokens (long: mid-stream)")
    p.add_argument("--probe-tokens", type=int, default=8, help="the probes' max_tokens (short)")
    p.add_argument("--probe-interval", type=float, default=0.1, help="seconds between probes while down")
    p.add_argument("--timeout", type=float, default=180.0, help="bound of every wait (seconds)")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url is not None:
        result = asyncio.run(supervise(check_loopback_url(args.url), args))
    else:
        result = run_local(args)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    bad = check(result)
    print("PASS" if not bad else "FAIL: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
