"""Barge-in load against a live ``omnirelay serve``: many realtime sessions that speak over
their answers, again and again, and nothing left behind.

The script starts ``omnirelay serve`` (``qwen3-omni-tiny`` by default; ``--pipeline
voice-cpu`` or any pipeline) on a free loopback port and opens ``--sessions`` WebSocket
sessions on ``/v1/realtime`` at once. Each runs ``--rounds`` rounds of:

1. a text question and ``response.create``;
2. at its first audio delta, speech (synthesized: a voiced sound over background noise)
   appended to the input buffer — the server VAD's ``speech_started`` must cancel the
   answer: ``response.done`` with status ``cancelled``;
3. background noise until ``speech_stopped`` ends the spoken turn.

Counted: answers cut by barge-in, answers that ended before the speech reached them,
answers refused for capacity (``server_busy``: the session waits ``retry_after_s`` and
asks again), the time from ``speech_started`` to ``response.done`` as the client saw it,
and any event of a response after its ``response.done`` (there must be none). Then, with
nothing in flight: ``/health`` healthy, ``/health?audit=1`` clean (no request state in
any stage), no traceback in the server's log, exit 0 on SIGTERM and no ``omnirelay-*``
object of its namespace in /dev/shm. Exit status 0 when every check passed.

Run it from the repository root: ``python3 -m benchmarks.realtime_bargein --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets

from benchmarks.load_serve import ServerProcess, _settled_health
from omnirelay.connectors.shm import sweep

__all__ = ["main", "run"]

QUESTION = "Tell me a long story about the sea."


@dataclass
class Counts:
    sessions: int = 0
    rounds: int = 0
    cut: int = 0
    ended_first: int = 0
    refused: int = 0
    late_events: int = 0
    errors: list[str] = field(default_factory=list)
    cut_latency_s: list[float] = field(default_factory=list)


def _speech(rate: int, seconds: float, seed: int) -> np.ndarray:
    """A voiced sound (harmonics of a gliding pitch, a 4 Hz syllable swing) over noise."""
    n = round(rate * seconds)
    t = np.arange(n) / rate
    phase = 2 * np.pi * np.cumsum(140 + 20 * np.sin(2 * np.pi * 0.7 * t)) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    return (0.3 * voice / np.max(np.abs(voice)) + _noise(rate, seconds, seed)).astype(np.float32)


def _noise(rate: int, seconds: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(round(rate * seconds)).astype(np.float32) * 1e-3


def _appends(samples: np.ndarray, rate: int) -> list[str]:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    step = rate // 10
    return [
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(pcm[i : i + step].tobytes()).decode(),
            }
        )
        for i in range(0, pcm.size, step)
    ]


class _Session:
    def __init__(self, ws: Any, counts: Counts, timeout_s: float) -> None:
        self.ws = ws
        self.counts = counts
        self.timeout_s = timeout_s
        self.done: set[str] = set()  # responses whose response.done arrived

    async def next(self) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(await asyncio.wait_for(self.ws.recv(), self.timeout_s))
        rid = event.get("response_id") or (event.get("response") or {}).get("id")
        if rid in self.done:
            self.counts.late_events += 1
        if event["type"] == "response.done":
            self.done.add(event["response"]["id"])
        return event

    async def until(self, *kinds: str) -> dict[str, Any]:
        while True:
            event = await self.next()
            if event["type"] in kinds:
                return event

    async def round(self, rate: int, seed: int) -> None:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
        await self.ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        while True:
            await self.ws.send(
                json.dumps({"type": "response.create", "response": {"max_response_output_tokens": 400}})
            )
            event = await self.until("response.audio.delta", "response.done")
            if event["type"] == "response.audio.delta":
                break
            if (event["response"]["status_details"] or {}).get("error", {}).get("code") != "server_busy":
                self.counts.ended_first += 1  # done before any audio: nothing to speak over
                return
            self.counts.refused += 1
            await asyncio.sleep(1.0)  # Retry-After of a refused response
        for frame in _appends(np.concatenate([_noise(rate, 0.2, seed), _speech(rate, 0.5, seed)]), rate):
            await self.ws.send(frame)
        started = await self.until("input_audio_buffer.speech_started")
        t_started = time.monotonic()
        if event["response_id"] in self.done:
            self.counts.ended_first += 1  # the answer ended before the speech reached it
        else:
            done = await self.until("response.done")
            if done["response"]["status"] == "cancelled":
                self.counts.cut += 1
                self.counts.cut_latency_s.append(time.monotonic() - t_started)
            else:
                self.counts.ended_first += 1
        for frame in _appends(_noise(rate, 0.8, seed + 1), rate):
            await self.ws.send(frame)
        stopped = await self.until("input_audio_buffer.speech_stopped")
        assert stopped["item_id"] == started["item_id"]
        self.counts.rounds += 1


async def _one(url: str, counts: Counts, index: int, rounds: int, timeout_s: float) -> None:
    try:
        async with websockets.connect(url, max_size=2**24) as ws:
            session = _Session(ws, counts, timeout_s)
            created = await session.until("session.created")
            rate = int(created["session"]["sample_rate"])
            # The spoken turns only cut answers here; they do not ask for new ones.
            update = {"turn_detection": {"type": "server_vad", "create_response": False}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await session.until("session.updated")
            for r in range(rounds):
                await session.round(rate, seed=index * 1000 + r)
            counts.sessions += 1
    except Exception as exc:
        counts.errors.append(f"session {index}: {type(exc).__name__}: {exc}")


async def _all(url: str, args: argparse.Namespace) -> Counts:
    counts = Counts()
    rt = url.replace("http://", "ws://") + "/v1/realtime"
    await asyncio.gather(*(_one(rt, counts, i, args.rounds, args.timeout_s) for i in range(args.sessions)))
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    server = ServerProcess(args.pipeline, args.max_concurrency)
    server.start(args.startup_timeout_s)
    t0 = time.perf_counter()
    try:
        counts = asyncio.run(_all(server.url, args))
        elapsed = time.perf_counter() - t0
        health = asyncio.run(_settled_health(server.url, 60.0))
    finally:
        exit_code = server.stop()
    left = [o.name for o in sweep(server.namespace).objects] if server.namespace else []
    tracebacks = sum("Traceback" in line for line in server.lines)
    audit = health.get("audit") or {}
    lat = sorted(counts.cut_latency_s)
    checks = {
        "every session ran all its rounds": counts.sessions == args.sessions and not counts.errors,
        "no event of a response after its response.done": counts.late_events == 0,
        "health OK afterwards": health.get("http_status") == 200 and health.get("status") == "healthy",
        "no request state afterwards (audit clean)": audit.get("clean") is True,
        "no traceback in the server log": tracebacks == 0,
        "server stopped cleanly on SIGTERM (exit 0)": exit_code == 0,
        "no omnirelay-* object of the namespace in /dev/shm": not left,
    }
    return {
        "pipeline": args.pipeline,
        "sessions": args.sessions,
        "rounds_per_session": args.rounds,
        "rounds_run": counts.rounds,
        "cut_by_barge_in": counts.cut,
        "ended_before_the_speech": counts.ended_first,
        "refused_for_capacity": counts.refused,
        "late_events": counts.late_events,
        "cut_latency_ms": {
            "p50": round(statistics.median(lat) * 1000, 1) if lat else None,
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 1) if lat else None,
            "max": round(lat[-1] * 1000, 1) if lat else None,
        },
        "elapsed_s": round(elapsed, 1),
        "audit": audit,
        "errors": counts.errors[:10],
        "checks": checks,
        "ok": all(checks.values()),
    }


def render(report: dict[str, Any]) -> str:
    lat = report["cut_latency_ms"]
    lines = [
        f"realtime barge-in: {report['sessions']} sessions x {report['rounds_per_session']} rounds on "
        f"{report['pipeline']} ({report['elapsed_s']} s)",
        f"  rounds run                   {report['rounds_run']}",
        f"  answers cut by barge-in      {report['cut_by_barge_in']}",
        f"  answers ended before speech  {report['ended_before_the_speech']}",
        f"  refused for capacity         {report['refused_for_capacity']}",
        f"  events after response.done   {report['late_events']}",
        f"  speech_started -> cancelled  p50 {lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms",
        f"  audit                        {json.dumps(report['audit'])}",
    ]
    lines += [f"  error: {e}" for e in report["errors"]]
    lines += [f"  [{'ok' if ok else 'FAILED'}] {name}" for name, ok in report["checks"].items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.realtime_bargein", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--pipeline", default="qwen3-omni-tiny", help="pipeline to serve (default qwen3-omni-tiny)"
    )
    p.add_argument("--sessions", type=int, default=50, help="sessions at once (default 50)")
    p.add_argument("--rounds", type=int, default=3, help="barge-ins per session (default 3)")
    p.add_argument(
        "--max-concurrency", type=int, default=64, help="the server's --max-concurrency (default 64)"
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for one event (default 300)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--json", default=None, help="write the report here too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
