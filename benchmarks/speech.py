"""``omnirelay bench speech``: text-to-speech under open-loop Poisson arrivals.

For each request rate ``λ`` (default 1 and 20 requests/s) the benchmark submits speech
requests at the times of a seeded Poisson process — exponential gaps of mean ``1/λ``,
whatever the pipeline's backlog (open loop: a slow pipeline is not given a rest, as a
closed loop of clients would) — for ``duration_s`` seconds of arrivals, each request a
sentence of a fixed set read by the pipeline's speech prompt (the default voice), through
the real multi-process pipeline. Per rate, over the requests that arrived:

* **first playable audio** p50/p95/p99 — the earliest moment a player that started then
  would never run dry (:mod:`omnirelay.timeline.playback`), from the request's arrival;
  and the time to the first audio;
* **gap-free streams** — the share whose worst underrun (a player starting at the first
  audio) is at most 50 ms;
* **real-time factor** — per stream, the time from its first to its last audio over the
  audio after the first chunk (< 1: made faster than it plays), and end-to-end time over
  the audio's length;
* **requests/s** completed and audio seconds made per second, over the span from the
  first arrival to the last completion; how late the dispatcher submitted (it must keep up).

A random-weight model (``load_format: dummy``) rarely says EOS, so every request's frames
are capped at the length of speech its text needs (``frames_for``: 14 characters a second,
12.5 frames a second) — with a real checkpoint that cap only bounds a runaway. Warm-up
requests (lazy initialisation, first compiles) come first and are not counted; the run ends
with a leak audit. Targets (one H200, 1.7B CustomVoice, dummy weights; judged only when a
model stage ran on CUDA): first playable audio p50 ≤ 100 ms at 1 request/s and ≤ 150 ms at
20 requests/s, and ≥ 99 % of streams gap-free at both.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import msgspec
import torch

from benchmarks.pipeline import _commit, _gpu_names, is_gpu_run, step_times, stream_rtf
from omnirelay.cli.session import load_run_config, open_prompt_side, start_pipeline
from omnirelay.timeline import RequestTimeline, StageTrace, drive_request

if TYPE_CHECKING:
    from omnirelay.api import Pipeline
    from omnirelay.engine.interfaces import SamplingParams

__all__ = [
    "DEFAULT_RATES",
    "GAP_FREE_TARGET",
    "PLAYABLE_TARGETS_S",
    "TEXTS",
    "bench_running_speech",
    "frames_for",
    "poisson_arrivals",
    "render_speech_bench",
    "run_speech_bench",
    "targets_met",
]

DEFAULT_RATES = (1.0, 20.0)
#: First playable audio targets (p50, seconds) on one GPU, by request rate.
PLAYABLE_TARGETS_S = {1.0: 0.100, 20.0: 0.150}
#: Least share of gap-free streams (worst gap <= 50 ms) on one GPU, at every rate.
GAP_FREE_TARGET = 0.99
#: Speech of the length of its text: characters per second, and the codec's frames per second.
CHARS_PER_S = 14.0
FRAMES_PER_S = 12.5
#: What the requests say, in turn: sentences of 3 to 25 words.
TEXTS = (
    "Hello there.",
    "Good morning, how are you today?",
    "The train to the airport leaves from platform four in ten minutes.",
    "Please hold the line while I connect you to the next available agent.",
    "Thanks!",
    "It will be sunny in the morning, with clouds and light rain coming in from the west after lunch.",
    "Your order has shipped and should arrive on Thursday.",
    "Turn left at the next intersection, then continue straight for about two kilometres.",
    "I did not catch that; could you say it again, a little more slowly?",
    "The meeting moved to three o'clock.",
    "Once upon a time, in a village by the sea, there lived an old fisherman and his curious granddaughter.",
    "Set a timer for twelve minutes.",
)


def frames_for(text: str) -> int:
    """Codec frames of speech that says ``text`` at :data:`CHARS_PER_S` (the frame cap of a request)."""
    return max(8, math.ceil(len(text) / CHARS_PER_S * FRAMES_PER_S) + 4)


def poisson_arrivals(rate: float, num: int, seed: int) -> list[float]:
    """``num`` arrival times (seconds from the start) of a Poisson process of ``rate`` per second."""
    if rate <= 0 or num < 1:
        raise ValueError(f"a Poisson process needs rate > 0 and at least one arrival, got {rate}, {num}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]

    return {
        "p50": pct(50),
        "p95": pct(95),
        "p99": pct(99),
        "mean": statistics.fmean(ordered),
        "max": ordered[-1],
    }


class _Prompt(msgspec.Struct, frozen=True):
    text: str
    ids: list[int]
    inputs: Any
    sampling: dict[int, Any]


def _run_rate(
    pipe: Pipeline,
    trace: StageTrace,
    prompts: Sequence[_Prompt],
    rate: float,
    num: int,
    seed: int,
    timeout_s: float,
) -> tuple[list[RequestTimeline], list[float], float]:
    """``num`` requests at the times of a Poisson process; their timelines (in arrival
    order), how late each was submitted, and the span from the first arrival to the last
    completion."""
    arrivals = poisson_arrivals(rate, num, seed)
    results: list[RequestTimeline | None] = [None] * num
    lags = [0.0] * num
    ends = [0.0] * num
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int, start: float) -> None:
        prompt = prompts[i % len(prompts)]
        lags[i] = time.monotonic() - start - arrivals[i]
        try:
            tl = drive_request(
                pipe, trace, prompt.ids, modalities=["audio"], sampling=prompt.sampling, inputs=prompt.inputs
            )
        except BaseException as exc:  # reported after the join
            with lock:
                errors.append(exc)
            return
        results[i] = tl
        ends[i] = time.monotonic() - start

    start = time.monotonic()
    threads = []
    for i, at in enumerate(arrivals):
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the open loop's clock: arrivals do not wait for the pipeline
        t = threading.Thread(target=one, args=(i, start), name=f"omnirelay-bench-speech-{i}", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=max(0.0, timeout_s - (time.monotonic() - start)))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"rate {rate:g}/s: the requests did not finish within {timeout_s:g} s")
    if errors:
        raise errors[0]
    done = [tl for tl in results if tl is not None]
    return done, lags, max(ends) if ends else 0.0


def _rate_report(
    rate: float, timelines: list[RequestTimeline], lags: list[float], span_s: float
) -> dict[str, Any]:
    heard = [t.playback for t in timelines if t.audio_chunks]
    audio_s = [t.num_samples / (t.sample_rate or 24000) for t in timelines]
    gap_free = sum(1 for p in heard if p.is_gap_free)
    return {
        "rate_per_s": rate,
        "num_requests": len(timelines),
        "span_s": span_s,
        "requests_per_s": len(timelines) / span_s if span_s > 0 else 0.0,
        "audio_s_per_s": sum(audio_s) / span_s if span_s > 0 else 0.0,
        "first_playable_s": _summary([p.first_playable_s for p in heard if p.first_playable_s is not None]),
        "first_audio_s": _summary([t.ttfa_s for t in timelines if t.ttfa_s is not None]),
        "worst_gap_s": _summary([p.worst_gap_s for p in heard]),
        "num_streams": len(heard),
        "num_gap_free_streams": gap_free,
        "gap_free_share": gap_free / len(heard) if heard else 0.0,
        "rtf": _summary([stream_rtf(t) for t in timelines]),
        "e2e_over_audio": _summary([t.total_s / a for t, a in zip(timelines, audio_s) if a > 0]),
        "audio_s": _summary(audio_s),
        "e2e_s": _summary([t.total_s for t in timelines]),
        "dispatch_lag_s": _summary(lags),
        "step_s": step_times(timelines),
    }


def _prompts(pipe: Pipeline, max_frames: int | None) -> list[_Prompt]:
    from omnirelay.orchestrator.requests import stage_sampling_defaults

    config = pipe.config
    side = pipe.prompt_side()
    if side is None:
        raise ValueError(f"pipeline {config.name!r}: its prompt stage writes no speech prompts")
    stage_id = config.prompt_stage_id
    base: SamplingParams = stage_sampling_defaults(config.stages[stage_id])
    out = []
    for text in TEXTS:
        prompt = side.speech_prompt(text)
        frames = frames_for(text) if max_frames is None else max_frames
        sampling = {stage_id: msgspec.structs.replace(base, max_tokens=min(base.max_tokens, frames))}
        out.append(_Prompt(text, list(prompt.prompt_token_ids), prompt.inputs, sampling))
    return out


def bench_running_speech(
    pipe: Pipeline,
    trace: StageTrace,
    *,
    rates: Sequence[float] = DEFAULT_RATES,
    duration_s: float = 60.0,
    requests: int | None = None,
    warmup: int = 4,
    seed: int = 0,
    max_frames: int | None = None,
    timeout_s: float = 900.0,
    stream: TextIO | None = None,
    busy_device: str | None = None,
) -> dict[str, Any]:
    """The measurement on a running pipeline (started with ``on_stage_output=trace,
    trace_steps=True``): per rate, ``requests`` arrivals (default ``rate · duration_s``, at
    least 8). Ends with a leak audit; the pipeline keeps running. ``busy_device``: the
    CUDA device whose busy share each rate reports (:class:`benchmarks.gpu_busy.BusySampler`)."""
    from benchmarks.gpu_busy import BusySampler
    from omnirelay.connectors.shm import sweep
    from omnirelay.worker import leak_paths

    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates must be > 0, got {list(rates)}")
    err = stream if stream is not None else sys.stderr
    prompts = _prompts(pipe, max_frames)
    for i in range(warmup):
        err.write(f"warm-up request {i + 1}/{warmup}\n")
        p = prompts[i % len(prompts)]
        drive_request(pipe, trace, p.ids, modalities=["audio"], sampling=p.sampling, inputs=p.inputs)
    report: dict[str, Any] = {
        "pipeline": pipe.config.name,
        "warmup": warmup,
        "seed": seed,
        "texts": list(TEXTS),
        "max_frames": max_frames,
        "targets": {
            "first_playable_p50_s": {str(k): v for k, v in PLAYABLE_TARGETS_S.items()},
            "gap_free_share": GAP_FREE_TARGET,
        },
        "rates": [],
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": len(os.sched_getaffinity(0)),
            "loadavg_start": os.getloadavg(),
            "gpus": _gpu_names(),
            "commit": _commit(),
        },
    }
    for k, rate in enumerate(rates):
        n = requests if requests is not None else max(8, math.ceil(rate * duration_s))
        err.write(f"rate {rate:g}/s: {n} requests (Poisson arrivals)\n")
        err.flush()
        with BusySampler(busy_device) as busy:
            timelines, lags, span = _run_rate(pipe, trace, prompts, rate, n, seed + k, timeout_s)
        level = _rate_report(rate, timelines, lags, span)
        level["device_busy_share"] = busy.share
        level["step_time_share"] = {
            sid: v["mean"] * v["count"] / span if span > 0 else 0.0 for sid, v in level["step_s"].items()
        }
        report["rates"].append(level)
    leaks = {sid: leak_paths(state) for sid, state in pipe.leak_state().items()}
    objects = [o.name for o in sweep(pipe.namespace).objects if not (o.kind == "slot" and o.state == "free")]
    report["audit"] = {
        "stage_state_left": {str(k): v for k, v in leaks.items() if v},
        "transfer_objects_left": objects,
        "traces_left": trace.num_watched,
    }
    report["env"]["loadavg_end"] = os.getloadavg()
    report["ok"] = not (objects or report["audit"]["stage_state_left"] or trace.num_watched)
    return report


def run_speech_bench(
    *,
    pipeline: str = "qwen3-tts",
    device: str | None = None,
    load_format: str | None = None,
    stream: TextIO | None = None,
    mps: bool = False,
    device_groups: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Start ``pipeline`` (``device``/``load_format`` as in
    :func:`~omnirelay.cli.session.load_run_config`), run :func:`bench_running_speech`
    (``options``) on it, shut it down and add the shutdown to the audit. ``mps``: the
    whole run under a private MPS daemon (:func:`benchmarks.mps.mps_daemon`), so the
    stages' kernels share the GPU at once instead of in time slices.
    ``device_groups`` (``auto``, ``on``, ``off``) overrides the pipeline's (docs/design.md
    §12); under ``mps`` it defaults to ``off``: a process per stage, which MPS shares."""
    daemon: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if mps:
        from benchmarks.mps import mps_daemon

        daemon = mps_daemon()
        device_groups = device_groups or "off"
    with daemon:
        report = _run_speech_bench(pipeline, device, load_format, stream, device_groups, **options)
    report["mps"] = mps
    return report


def _run_speech_bench(
    pipeline: str,
    device: str | None,
    load_format: str | None,
    stream: TextIO | None,
    device_groups: str | None,
    **options: Any,
) -> dict[str, Any]:
    from omnirelay.pipeline.groups import process_groups

    err = stream if stream is not None else sys.stderr
    config = load_run_config(pipeline, device=device, load_format=load_format)
    if device_groups is not None:
        config = config.with_device_groups(device_groups)
    options.setdefault("busy_device", device)
    open_prompt_side(config, err)  # what the models need first is made (and announced) here
    trace = StageTrace()
    pipe, startup_s = start_pipeline(config, on_stage_output=trace, trace_steps=True, stream=err)
    try:
        report = bench_running_speech(pipe, trace, stream=err, **options)
    finally:
        shutdown = pipe.shutdown()
    report.update(
        startup_s=startup_s,
        load_format=load_format,
        device_groups=config.device_groups.value,
        processes=[
            [config.stages[w.stage_id].name for w in _workers(config, g)] for g in process_groups(config)
        ],
        stage_args={s.name: dict(s.executor_args) for s in config.stages},
        codec_schedule={
            n: dict(c.extra) for n, c in config.connectors.items() if any("codec_" in k for k in c.extra)
        },
    )
    report["audit"].update(
        shutdown_killed=shutdown.num_killed, shutdown_objects_left=shutdown.num_objects_left
    )
    report["ok"] = report["ok"] and not (shutdown.num_killed or shutdown.num_objects_left)
    report["targets_met"] = {str(k): v for k, v in targets_met(report).items()}
    return report


def _workers(config: Any, group: Sequence[int]) -> list[Any]:
    workers = config.workers()
    return [workers[i] for i in group]


def targets_met(report: dict[str, Any]) -> dict[float, bool]:
    """Per measured rate with a target: first playable audio p50 within
    :data:`PLAYABLE_TARGETS_S` and at least :data:`GAP_FREE_TARGET` of the streams gap-free.
    Empty off a GPU (the targets are the full-size model's on one H200)."""
    if not is_gpu_run(report):
        return {}
    out = {}
    for level in report["rates"]:
        target = PLAYABLE_TARGETS_S.get(float(level["rate_per_s"]))
        playable = level["first_playable_s"]
        if target is not None:
            out[float(level["rate_per_s"])] = bool(
                playable is not None
                and playable["p50"] <= target
                and level["gap_free_share"] >= GAP_FREE_TARGET
            )
    return out


def _ms(summary: dict[str, float] | None, key: str) -> str:
    return "-" if summary is None else f"{summary[key] * 1000:.0f}"


def render_speech_bench(report: dict[str, Any]) -> str:
    """The report as a table."""
    lines = [
        f"bench speech: {report['pipeline']} (open-loop Poisson arrivals; {report['warmup']} warm-up requests"
        + ("; under MPS" if report.get("mps") else "")
        + (
            f"; processes: {' | '.join('+'.join(p) for p in report['processes'])})"
            if report.get("processes")
            else ")"
        ),
        f"{'rate/s':>7} {'n':>5} {'req/s':>6} {'audio s/s':>9} {'playable p50/p95/p99 ms':>24} "
        f"{'first audio p50 ms':>18} {'gap-free':>9} {'worst gap p95 ms':>16} {'rtf p50/p95':>12} {'lag max ms':>10}",
    ]
    for lv in report["rates"]:
        fp = lv["first_playable_s"]
        playable = f"{_ms(fp, 'p50')}/{_ms(fp, 'p95')}/{_ms(fp, 'p99')}"
        rtf = lv["rtf"]
        rtf_s = "-" if rtf is None else f"{rtf['p50']:.2f}/{rtf['p95']:.2f}"
        lines.append(
            f"{lv['rate_per_s']:>7g} {lv['num_requests']:>5} {lv['requests_per_s']:>6.2f} {lv['audio_s_per_s']:>9.1f} "
            f"{playable:>24} {_ms(lv['first_audio_s'], 'p50'):>18} {lv['gap_free_share']:>8.1%} "
            f"{_ms(lv['worst_gap_s'], 'p95'):>16} {rtf_s:>12} {_ms(lv['dispatch_lag_s'], 'max'):>10}"
        )
        steps = lv.get("step_s") or {}
        if steps:
            lines.append(
                f"{'':>7} step p50/p99 ms: "
                + ", ".join(
                    f"stage {sid} {v['p50'] * 1000:.1f}/{v['p99'] * 1000:.1f} ({v['count']} steps)"
                    for sid, v in sorted(steps.items(), key=lambda kv: int(kv[0]))
                )
            )
        shares = lv.get("step_time_share") or {}
        if shares:
            busy = lv.get("device_busy_share")
            lines.append(
                f"{'':>7} step time over wall: "
                + ", ".join(
                    f"stage {sid} {v:.0%}" for sid, v in sorted(shares.items(), key=lambda kv: int(kv[0]))
                )
                + f", sum {sum(shares.values()):.0%}"
                + ("" if busy is None else f"; device busy {busy:.0%}")
            )
    met = report.get("targets_met") or {}
    if met:
        lines.append(
            "targets (p50 first playable <= 100 ms at 1/s, <= 150 ms at 20/s; >= 99% gap-free): "
            + ", ".join(f"{k}/s {'met' if v else 'MISSED'}" for k, v in met.items())
        )
    else:
        lines.append("targets: judged on a GPU run only (the full-size model's)")
    audit = report["audit"]
    lines.append(
        "leak audit: "
        + ("clean" if report["ok"] else f"LEFT {audit}")
        + f" (startup {report.get('startup_s', 0.0):.1f} s)"
    )
    return "\n".join(lines)
