"""``omnirelay bench serve``: a load generator against the OpenAI-compatible server.

Each request is a streaming ``POST /v1/audio/speech`` (``response_format: "wav"``,
``stream: true``): the 44-byte WAV header gives the sample rate, every byte after it is
16-bit mono PCM. For each concurrency level ``c`` (default 1, 8, 32) ``c`` client tasks
on one ``httpx.AsyncClient`` keep ``c`` requests in flight until ``requests`` requests
have been sent (default ``max(8, 2 x c)``). Per level:

* **TTFA** — request sent to the first audio byte received (after the header), p50/p99;
* **RTF (aggregate)** — audio seconds received by all clients / the level's wall time
  (> 1: the server makes audio faster than real time);
* **processing / audio** — per request, end-to-end time / its audio duration, p50/p99
  (< 1: that request was served faster than real time);
* **requests/s** — successful requests / the level's wall time;
* **errors** — by kind (HTTP status, ``timeout``, ``transport``, ``no_audio``).

Warm-up requests (uncounted) run first. Everything is bounded: the number of requests
and the concurrency have upper limits, each level has a deadline (``timeout_s``) after
which outstanding requests are cancelled and counted as timeouts. Only loopback
servers are driven: with ``url`` the host must be a loopback address or ``localhost``;
without it the bench starts the pipeline and a server on 127.0.0.1 (a free port), and
stops both at the end, after a leak audit (no request state in any stage, no transfer
object left).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import platform
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from omnirelay.interpreter import interpreter_info

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PIPELINE",
    "check_loopback_url",
    "render_serve_bench",
    "run_serve_bench",
]

DEFAULT_PIPELINE = "qwen3-omni-tiny"
DEFAULT_CONCURRENCY = (1, 8, 32)
DEFAULT_TEXT = "Good morning, this is a benchmark of the speech endpoint."
MAX_CONCURRENCY = 256
MAX_REQUESTS = 10_000
_WAV_HEADER = 44


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def check_loopback_url(url: str) -> str:
    """``url`` without a trailing slash, if it is http(s) on a loopback host; else ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be like http://127.0.0.1:8000, got {url!r}")
    host = parts.hostname
    if host != "localhost":
        try:
            is_loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            is_loopback = False
        if not is_loopback:
            raise ValueError(
                f"--url must point to a loopback address (127.0.0.1, ::1, localhost), got {host!r}"
            )
    return url.rstrip("/")


@dataclass
class _Result:
    ok: bool
    error: str | None = None
    ttfa_s: float | None = None
    total_s: float = 0.0
    audio_s: float = 0.0


async def _one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> _Result:
    t0 = time.perf_counter()
    ttfa: float | None = None
    header = b""
    num_bytes = 0
    try:
        async with client.stream("POST", url + "/v1/audio/speech", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _Result(False, f"http_{resp.status_code}", total_s=time.perf_counter() - t0)
            async for chunk in resp.aiter_bytes():
                if len(header) < _WAV_HEADER:
                    need = _WAV_HEADER - len(header)
                    header += chunk[:need]
                    chunk = chunk[need:]
                if chunk:
                    if ttfa is None:
                        ttfa = time.perf_counter() - t0
                    num_bytes += len(chunk)
    except httpx.TimeoutException:
        return _Result(False, "timeout", total_s=time.perf_counter() - t0)
    except httpx.HTTPError:
        return _Result(False, "transport", total_s=time.perf_counter() - t0)
    total = time.perf_counter() - t0
    if len(header) < _WAV_HEADER or header[:4] != b"RIFF" or num_bytes == 0:
        return _Result(False, "no_audio", total_s=total)
    rate = struct.unpack("<I", header[24:28])[0]
    return _Result(True, ttfa_s=ttfa, total_s=total, audio_s=(num_bytes // 2) / max(rate, 1))


async def _run_level(
    url: str, body: dict[str, Any], concurrency: int, requests: int, timeout_s: float
) -> tuple[list[_Result], float, int]:
    """``requests`` requests with ``concurrency`` in flight; (results, wall seconds, cancelled)."""
    results: list[_Result] = []
    remaining = requests
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                results.append(await _one_request(client, url, body))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        for t in done:
            t.result()  # a bug in the client surfaces here
    cancelled = len(pending)  # each pending worker had one request in flight
    results.extend(_Result(False, "timeout", total_s=wall) for _ in range(cancelled))
    return results, wall, cancelled


def _summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "mean": sum(values) / len(values)}


def _level_report(concurrency: int, results: list[_Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    audio_s = sum(r.audio_s for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok and r.error)),
        "wall_s": wall,
        "ttfa_s": _summary([r.ttfa_s for r in ok if r.ttfa_s is not None]),
        "latency_s": _summary([r.total_s for r in ok]),
        "audio_s": audio_s,
        "rtf_aggregate": audio_s / wall if wall > 0 else None,
        "processing_per_audio": _summary([r.total_s / r.audio_s for r in ok if r.audio_s > 0]),
        "requests_per_s": len(ok) / wall if wall > 0 else None,
    }


async def _drive(
    url: str,
    model: str | None,
    levels: Sequence[int],
    requests: int | None,
    warmup: int,
    text: str,
    voice: str,
    timeout_s: float,
) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        if model is None:
            resp = await client.get(url + "/v1/models")
            resp.raise_for_status()
            model = str(resp.json()["data"][0]["id"])
    body = {
        "model": model,
        "input": text,
        "voice": voice,
        "response_format": "wav",
        "stream": True,
    }
    if warmup:
        await _run_level(url, body, 1, warmup, timeout_s)
    out = []
    for c in levels:
        n = requests if requests is not None else max(8, 2 * c)
        results, wall, _ = await _run_level(url, body, c, n, timeout_s)
        out.append(_level_report(c, results, wall))
    return {"url": url, "model": model, "text": text, "voice": voice, "warmup": warmup, "levels": out}


def _validate(levels: Sequence[int], requests: int | None, warmup: int, timeout_s: float) -> None:
    if not levels:
        raise ValueError("at least one concurrency level is needed")
    for c in levels:
        if not 1 <= c <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency levels must be in 1..{MAX_CONCURRENCY}, got {c}")
    if requests is not None and not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be in 1..{MAX_REQUESTS}, got {requests}")
    if not 0 <= warmup <= 100:
        raise ValueError(f"--warmup must be in 0..100, got {warmup}")
    if not 0 < timeout_s <= 3600:
        raise ValueError(f"--timeout must be in (0, 3600] seconds, got {timeout_s}")


def run_serve_bench(
    *,
    pipeline: str = DEFAULT_PIPELINE,
    url: str | None = None,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    requests: int | None = None,
    warmup: int = 1,
    text: str = DEFAULT_TEXT,
    voice: str = "alloy",
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """The report of one bench run (see the module docstring); ValueError on bad arguments."""
    levels = list(concurrency)
    _validate(levels, requests, warmup, timeout_s)
    if not text.strip():
        raise ValueError("--text must not be empty")
    env = {
        "python": platform.python_version(),
        "interpreter": interpreter_info().to_dict(),
        "httpx": httpx.__version__,
    }
    if url is not None:
        report = asyncio.run(
            _drive(check_loopback_url(url), None, levels, requests, warmup, text, voice, timeout_s)
        )
        report.update(self_started=False, pipeline=None, audit=None, env=env)
        return _finish(report)

    from omnirelay.api import Pipeline
    from omnirelay.cli.serve import server_config
    from omnirelay.serving import ServerThread, create_app
    from omnirelay.worker import leak_paths

    pipe = Pipeline.start(pipeline)
    audit: dict[str, Any] = {}
    try:
        # The pipeline's own voices and rate, as serve has them (voice-cpu speaks with joe).
        config = server_config(pipe.config, max_concurrency=max(64, max(levels)))
        app = create_app(pipe, config)
        with ServerThread(app, host="127.0.0.1", port=0) as server:
            report = asyncio.run(
                _drive(server.base_url, None, levels, requests, warmup, text, voice, timeout_s)
            )
            fe = app.state.frontend
            deadline = time.monotonic() + 30.0
            while (fe.admission.num_active or pipe.num_active) and time.monotonic() < deadline:
                time.sleep(0.01)
            audit["in_flight"] = {"server": fe.admission.num_active, "pipeline": pipe.num_active}
            states = pipe.leak_state()
            audit["stage_state"] = {str(sid): leak_paths(s) for sid, s in states.items() if leak_paths(s)}
    finally:
        shutdown = pipe.shutdown()
    audit["objects_left"] = shutdown.num_objects_left
    audit["killed"] = shutdown.num_killed
    audit["clean"] = (
        not any(audit["in_flight"].values())
        and not audit["stage_state"]
        and shutdown.num_objects_left == 0
        and shutdown.num_killed == 0
    )
    report.update(self_started=True, pipeline=pipe.config.name, audit=audit, env=env)
    return _finish(report)


def _finish(report: dict[str, Any]) -> dict[str, Any]:
    audit = report.get("audit")
    report["ok"] = all(lv["ok"] > 0 for lv in report["levels"]) and (audit is None or audit["clean"])
    return report


def render_serve_bench(report: dict[str, Any]) -> str:
    def ms(s: dict[str, float] | None, key: str) -> str:
        return "-" if s is None else f"{s[key] * 1000:,.0f}"

    def num(v: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    where = f"pipeline {report['pipeline']} (self-started)" if report["self_started"] else report["url"]
    lines = [
        f"omnirelay bench serve: {where}, model {report['model']}, streaming /v1/audio/speech (wav), "
        f"voice {report['voice']}, {len(report['text'])} chars of input, {report['warmup']} warm-up",
        "",
        f"{'conc':>4}  {'reqs':>4}  {'ok':>4}  {'TTFA p50 ms':>11}  {'TTFA p99 ms':>11}  "
        f"{'RTF agg':>7}  {'proc/audio p50':>14}  {'proc/audio p99':>14}  {'req/s':>6}  {'audio s':>7}  errors",
    ]
    for lv in report["levels"]:
        ppa = lv["processing_per_audio"]
        errors = ", ".join(f"{k}={v}" for k, v in sorted(lv["errors"].items())) or "0"
        lines.append(
            f"{lv['concurrency']:>4}  {lv['requests']:>4}  {lv['ok']:>4}  {ms(lv['ttfa_s'], 'p50'):>11}  "
            f"{ms(lv['ttfa_s'], 'p99'):>11}  {num(lv['rtf_aggregate']):>7}  "
            f"{num(ppa and ppa['p50']):>14}  {num(ppa and ppa['p99']):>14}  "
            f"{num(lv['requests_per_s']):>6}  {lv['audio_s']:>7.1f}  {errors}"
        )
    lines += [
        "",
        "TTFA: request sent -> first audio byte.  RTF agg: audio seconds received / wall seconds "
        "(> 1 is faster than real time).  proc/audio: per request, end-to-end time / its audio "
        "duration (< 1 is faster than real time).",
    ]
    audit = report.get("audit")
    if audit is not None:
        verdict = "clean" if audit["clean"] else "LEAKS"
        lines.append(
            f"leak audit: {verdict} (in flight {audit['in_flight']}, stage state "
            f"{audit['stage_state'] or 'none'}, objects left {audit['objects_left']}, "
            f"workers killed {audit['killed']})"
        )
    return "\n".join(lines)
