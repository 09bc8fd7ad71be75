"""Load run against a live ``omnirelay serve``: clients that hang up early, clients that
finish, and nothing left behind.

The script starts ``omnirelay serve`` (``qwen3-omni-tiny`` by default; ``voice-cpu`` or any
pipeline with ``--pipeline``) on a free loopback port, then runs two phases of streaming
``POST /v1/audio/speech`` requests (``pcm``, which streams as it is made), at most
``--concurrency`` at a time:

1. **disconnect** — each client hangs up right after its first audio bytes (the server
   must abort the request through every stage);
2. **finish** — each client reads its audio to the end.

A request refused for capacity must be a 429 with ``Retry-After``; the client waits that
long and tries again (at most ``--max-attempts`` times, then it gives up). Every refusal
is counted; any other failure (another status, a broken or empty stream) fails the run.

Afterwards, with no request in flight, the checks: ``/health`` is healthy;
``/health?audit=1`` is clean (no per-request state in any stage, none tracked by the
orchestrator or the API, no transfer object of the namespace but the pooled slots); no
traceback in the server's log; and once the server is stopped with SIGTERM, as a service
manager stops it, it exits 0 and no ``omnirelay-*`` object of its namespace is left in
/dev/shm. Prints a table; ``--json`` writes the report. Exit status 0 when every check
passed, 1 otherwise.

Run it from the repository root: ``python3 -m benchmarks.load_serve --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from omnirelay.connectors.shm import sweep

__all__ = ["main", "render_load", "run_load"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PIPELINE = "qwen3-omni-tiny"
DEFAULT_TEXT = "Hello, this is a load test."
_READY = re.compile(r"omnirelay serve: \S+ on (http://\S+) \(.*namespace (\S+)\)")


@dataclass
class Phase:
    """What one phase's clients saw."""

    name: str
    clients: int
    served: int = 0
    refused_429: int = 0
    refused_without_retry_after: int = 0
    gave_up: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    first_audio_s: list[float] = field(default_factory=list)
    audio_bytes: int = 0
    audio_s: float = 0.0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        ttfa = sorted(self.first_audio_s)
        return {
            "name": self.name,
            "clients": self.clients,
            "served": self.served,
            "refused_429": self.refused_429,
            "refused_without_retry_after": self.refused_without_retry_after,
            "gave_up": self.gave_up,
            "errors": dict(self.errors),
            "first_audio_p50_s": ttfa[len(ttfa) // 2] if ttfa else None,
            "first_audio_p99_s": ttfa[min(len(ttfa) - 1, len(ttfa) * 99 // 100)] if ttfa else None,
            "audio_s": round(self.audio_s, 3),
            "wall_s": round(self.wall_s, 3),
        }


class ServerProcess:
    """``omnirelay serve`` in a child process on a free loopback port; its stderr kept."""

    def __init__(self, pipeline: str, max_concurrency: int) -> None:
        self.argv = [
            sys.executable, "-m", "omnirelay.cli.main", "serve", "--pipeline", pipeline,
            "--port", "0", "--max-concurrency", str(max_concurrency), "--log-level", "warning",
        ]  # fmt: skip
        self.lines: list[str] = []
        self.url = ""
        self.namespace = ""
        self._ready = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout_s: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name="serve-stderr", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"the server did not start within {timeout_s:g} s:\n{self.tail()}")
        if not self.url:
            raise RuntimeError(f"the server exited before it was ready:\n{self.tail()}")
        # The line comes just before uvicorn listens: ready is when /health answers.
        deadline = time.monotonic() + timeout_s
        while not self._is_healthy():
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server never answered /health:\n{self.tail()}")
            time.sleep(0.05)

    def _is_healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=10.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            self.lines.append(line.rstrip("\n"))
            found = _READY.search(line)
            if found:
                self.url, self.namespace = found.group(1), found.group(2)
                self._ready.set()
        self._ready.set()  # exited

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, as a service manager stops it; the exit status (None: it had to be killed)."""
        if self._proc is None:
            return None
        self._proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            code = None
        if self._reader is not None:
            self._reader.join(timeout_s)  # the log to its end
        assert self._proc.stderr is not None
        self._proc.stderr.close()
        return code

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


async def _one_client(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    phase: Phase,
    *,
    hang_up: bool,
    max_attempts: int,
) -> None:
    for _ in range(max_attempts):
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", url + "/v1/audio/speech", json=body) as resp:
                if resp.status_code == 429:
                    await resp.aread()
                    phase.refused_429 += 1
                    retry_after = resp.headers.get("retry-after", "")
                    if not retry_after.isdigit():
                        phase.refused_without_retry_after += 1
                    await asyncio.sleep(int(retry_after) if retry_after.isdigit() else 1)
                    continue
                if resp.status_code != 200:
                    await resp.aread()
                    phase.errors[f"http_{resp.status_code}"] += 1
                    return
                got = 0
                async for chunk in resp.aiter_raw():
                    if chunk and not got:
                        phase.first_audio_s.append(time.perf_counter() - t0)
                    got += len(chunk)
                    if got and hang_up:
                        break  # leaving the block closes the connection mid-stream
                if not got:
                    phase.errors["no_audio"] += 1
                    return
                phase.served += 1
                phase.audio_bytes += got
                phase.audio_s += got / 2 / int(resp.headers.get("x-sample-rate", "24000"))
                return
        except httpx.TimeoutException:
            phase.errors["timeout"] += 1
            return
        except httpx.HTTPError as exc:
            phase.errors[f"transport: {type(exc).__name__}"] += 1
            return
    phase.gave_up += 1


async def _run_phase(
    url: str, phase: Phase, body: dict[str, Any], concurrency: int, *, hang_up: bool, args: argparse.Namespace
) -> None:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async def client_task(client: httpx.AsyncClient) -> None:
        async with gate:
            await _one_client(client, url, body, phase, hang_up=hang_up, max_attempts=args.max_attempts)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits, trust_env=False) as client:
        await asyncio.gather(*(client_task(client) for _ in range(phase.clients)))
    phase.wall_s = time.perf_counter() - t0


async def _settled_health(url: str, timeout_s: float) -> dict[str, Any]:
    """``/health?audit=1`` once nothing is in flight (polled until then, with a deadline)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        while True:
            resp = await client.get(url + "/health", params={"audit": "1"})
            body: dict[str, Any] = resp.json()
            body["http_status"] = resp.status_code
            audit = body.get("audit") or {}
            idle = audit.get("num_in_flight") == 0 and audit.get("pipeline_requests") == 0
            if (idle and body.get("num_requests") == 0) or time.monotonic() > deadline:
                return body
            await asyncio.sleep(0.2)


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run both phases, audit, stop it; the report."""
    server = ServerProcess(args.pipeline, args.max_concurrency)
    t_start = time.perf_counter()
    server.start(args.startup_timeout_s)
    startup_s = time.perf_counter() - t_start
    phases = [Phase("disconnect", args.disconnect), Phase("finish", args.finish)]
    body: dict[str, Any] = {"input": args.text, "response_format": "pcm"}
    if args.voice:
        body["voice"] = args.voice
    try:
        for phase in phases:
            asyncio.run(
                _run_phase(
                    server.url, phase, body, args.concurrency, hang_up=phase.name == "disconnect", args=args
                )
            )
        health = asyncio.run(_settled_health(server.url, args.settle_timeout_s))
    finally:
        exit_code = server.stop()
    left = [o.name for o in sweep(server.namespace).objects] if server.namespace else []
    tracebacks = sum("Traceback" in line for line in server.lines)
    return _report(args, server, phases, health, exit_code, left, tracebacks, startup_s)


def _report(
    args: argparse.Namespace,
    server: ServerProcess,
    phases: list[Phase],
    health: dict[str, Any],
    exit_code: int | None,
    left: list[str],
    tracebacks: int,
    startup_s: float,
) -> dict[str, Any]:
    audit = health.get("audit") or {}
    checks = {
        # A client that gave up after --max-attempts 429s was refused as it should be.
        "every client served or refused with a 429": all(
            not p.errors and p.served + p.gave_up == p.clients for p in phases
        ),
        "every refusal a 429 with Retry-After": all(p.refused_without_retry_after == 0 for p in phases),
        "health OK afterwards": health.get("http_status") == 200 and health.get("status") == "healthy",
        "no request state afterwards (audit clean)": audit.get("clean") is True,
        "no traceback in the server log": tracebacks == 0,
        "server stopped cleanly on SIGTERM (exit 0)": exit_code == 0,
        "no omnirelay-* object of the namespace in /dev/shm": not left,
    }
    return {
        "pipeline": args.pipeline,
        "url": server.url,
        "namespace": server.namespace,
        "concurrency": args.concurrency,
        "max_concurrency": args.max_concurrency,
        "text": args.text,
        "startup_s": round(startup_s, 2),
        "phases": [p.to_dict() for p in phases],
        "audit": audit,
        "health_status": health.get("status"),
        "server_exit_code": exit_code,
        "shm_objects_left": left,
        "server_tracebacks": tracebacks,
        "server_log_tail": server.tail() if tracebacks or exit_code != 0 else "",
        "checks": checks,
        "passed": all(checks.values()),
    }


def render_load(report: dict[str, Any]) -> str:
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    out = [
        f"load_serve: {report['pipeline']} at {report['url']} (namespace {report['namespace']}), "
        f"{report['concurrency']} clients at a time, server limit {report['max_concurrency']}, "
        f"started in {report['startup_s']:.1f} s",
        "",
        f"{'phase':<11} {'clients':>7} {'served':>7} {'429s':>6} {'no R-A':>6} {'gave up':>7} {'errors':>6} "
        f"{'1st audio p50':>13} {'p99':>9} {'audio s':>8} {'wall s':>7}",
    ]
    for p in report["phases"]:
        out.append(
            f"{p['name']:<11} {p['clients']:>7} {p['served']:>7} {p['refused_429']:>6} "
            f"{p['refused_without_retry_after']:>6} {p['gave_up']:>7} {sum(p['errors'].values()):>6} "
            f"{sec(p['first_audio_p50_s']):>13} {sec(p['first_audio_p99_s']):>9} {p['audio_s']:>8.1f} "
            f"{p['wall_s']:>7.1f}"
        )
        if p["errors"]:
            out.append(f"{'':<11} errors: {p['errors']}")
    a = report["audit"]
    out += [
        "",
        f"afterwards: health {report['health_status']}, audit: {a.get('num_leaks')} leaks, "
        f"{a.get('pipeline_requests')} pipeline requests, {a.get('num_in_flight')} in flight, "
        f"{a.get('transfer_objects')} transfer objects; server exit {report['server_exit_code']}; "
        f"/dev/shm objects left: {len(report['shm_objects_left'])}",
        "",
    ]
    out += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in report["checks"].items()]
    if report["server_log_tail"]:
        out += ["", "server log (tail):", report["server_log_tail"]]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.load_serve",
        description=__doc__.split("\n\n", 1)[1]
        .split("Run it from")[0]
        .strip()
        .replace("``", "")
        .replace("**", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--pipeline",
        default=DEFAULT_PIPELINE,
        help=f"the pipeline to serve (default {DEFAULT_PIPELINE}, the fastest; voice-cpu: the real voice)",
    )
    p.add_argument(
        "--disconnect", type=int, default=1000, help="clients that hang up after their first audio (1000)"
    )
    p.add_argument("--finish", type=int, default=1000, help="clients that read their audio to the end (1000)")
    p.add_argument("--concurrency", type=int, default=64, help="clients at a time (64)")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="the server's --max-concurrency; lower it to force 429s (64)",
    )
    p.add_argument(
        "--text", default=DEFAULT_TEXT, help=f"what every request speaks (default {DEFAULT_TEXT!r})"
    )
    p.add_argument("--voice", default=None, help="the voice to ask for (default: the server's)")
    p.add_argument("--max-attempts", type=int, default=50, help="tries per client while it gets 429s (50)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout, seconds (300)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0, help="for the server to start (600)")
    p.add_argument(
        "--settle-timeout-s", type=float, default=60.0, help="for in-flight work to end afterwards (60)"
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON to PATH")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("disconnect", "finish", "concurrency", "max_concurrency", "max_attempts"):
        if getattr(args, name) < (0 if name in ("disconnect", "finish") else 1):
            parser.error(
                f"--{name.replace('_', '-')} must be at least {0 if name in ('disconnect', 'finish') else 1}"
            )
    try:
        report = run_load(args)
    except RuntimeError as exc:
        print(f"load_serve: error: {exc}", file=sys.stderr)
        return 1
    print(render_load(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if report["passed"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
