"""``omnirelay bench pipeline``: time to first audio and runtime overhead of a pipeline.

For each concurrency level (default 1, 4, 16) ``c`` client threads keep ``c`` requests
in flight on one running pipeline (real processes, shm connector; default the tiny
``qwen3-omni-tiny`` on the CPU, or e.g. the full-size ``qwen3-omni`` with
``--load-format dummy --device cuda:0``) until ``requests`` requests finished; each
request is a text+audio chat turn. Per request (:func:`~omnirelay.timeline.drive_request`):

* **TTFA** — submit to the client reading the first audio samples;
* **first playable audio** — the earliest moment a player could start and never run dry,
  and the **gaps** a player that starts at the first audio hears: the worst one, the total
  silence, and whether the stream was **gap-free** (worst gap ≤ 50 ms;
  :mod:`omnirelay.timeline.playback`);
* **overhead to first audio** — wall time on the critical path to the first audio minus
  the model compute on it (:func:`~omnirelay.timeline.critical_path`), as a share of
  TTFA; the same **to completion** (the last output), as a share of the end-to-end time.

* **real-time factor** of a stream — the time from its first to its last audio chunk
  over the audio that came after the first chunk (< 1: generated faster than it plays).

The table gives p50/p99 per level, the split of the overhead by kind (mean µs per
request: control plane, transfers, scheduling, delivery …), each stage's step times and
the targets: overhead ≤ 10% of TTFA at concurrency 1 (judged on the median request), and
on a GPU first playable audio p50 ≤ 150 ms / 400 ms / 1.0 s at concurrency 1 / 16 / 64
with 100 % / 99 % / 99 % of the streams gap-free. Warm-up requests (the first ones pay
lazy initialisation) are run and not counted. The run ends with a leak audit: no request
state in any stage, no transfer object in the namespace.

``schedule`` picks the Talker → Code2Wav chunk schedule: ``adaptive`` (the pipeline
file's own; the shipped default), ``fixed`` (the seed's: a first chunk of 4 frames, then
25) or ``both`` (the two one after the other, on two starts of the pipeline, in one run).

At higher concurrency the overhead includes waiting for other requests' steps (a stage
runs one executor call at a time): wall time on the critical path that is not this
request's model compute — by the definition, not a runtime cost per se.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import torch

from omnirelay.cli.session import load_run_config, open_tokenizer, start_pipeline
from omnirelay.interpreter import interpreter_info
from omnirelay.timeline import SEGMENTS, RequestTimeline, StageTrace, drive_request

if TYPE_CHECKING:
    from omnirelay.api import Pipeline

__all__ = [
    "DEFAULT_CONCURRENCY",
    "GAP_FREE_TARGETS",
    "OVERHEAD_TARGET",
    "PLAYABLE_TARGETS_S",
    "SCHEDULES",
    "audio_targets_met",
    "bench_running_pipeline",
    "is_gpu_run",
    "render_pipeline_bench",
    "render_streams",
    "run_pipeline_bench",
    "stream_rtf",
    "target_met",
    "with_codec_schedule",
]

DEFAULT_CONCURRENCY = (1, 4, 16)
#: The issue's target: runtime overhead ≤ 10% of time to first audio at concurrency 1.
OVERHEAD_TARGET = 0.10
#: First playable audio targets (p50, seconds) of the full-size model on one GPU, by concurrency.
PLAYABLE_TARGETS_S = {1: 0.150, 16: 0.400, 64: 1.000}
#: Least share of gap-free streams (worst gap <= 50 ms) on one GPU, by concurrency.
GAP_FREE_TARGETS = {1: 1.0, 16: 0.99, 64: 0.99}
#: Talker -> Code2Wav chunk schedules the benchmark can run.
SCHEDULES = ("adaptive", "fixed", "both")
#: The seed's fixed schedule: a first chunk of 4 frames, then 25 with 25 frames of left
#: context (docs/protocol.md §5.2), each chunk decoded as a window (no decoder state).
FIXED_SCHEDULE = {
    "codec_chunk_adaptive": False,
    "initial_codec_chunk_frames": 4,
    "codec_chunk_frames": 25,
    "codec_left_context_frames": 25,
}
DEFAULT_PROMPT = "Hello, who are you?"
#: Qwen3-Omni's Code2Wav: samples per codec frame (80 ms at 24 kHz).
SAMPLES_PER_FRAME = 1920


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


def _run_level(
    pipe: Any, trace: StageTrace, prompt: list[int], concurrency: int, requests: int, timeout_s: float
) -> tuple[list[RequestTimeline], float]:
    """``requests`` requests with ``concurrency`` in flight (closed loop)."""
    lock = threading.Lock()
    next_index = 0
    done: list[RequestTimeline] = []
    errors: list[BaseException] = []

    def client() -> None:
        nonlocal next_index
        while True:
            with lock:
                if next_index >= requests or errors:
                    return
                next_index += 1
            try:
                tl = drive_request(pipe, trace, prompt, modalities=["text", "audio"])
            except BaseException as exc:  # reported after the join
                with lock:
                    errors.append(exc)
                return
            with lock:
                done.append(tl)

    start = time.monotonic()
    threads = [
        threading.Thread(target=client, name=f"omnirelay-bench-client-{i}", daemon=True)
        for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, timeout_s - (time.monotonic() - start)))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"concurrency {concurrency}: the requests did not finish within {timeout_s:g} s")
    if errors:
        raise errors[0]
    return done, time.monotonic() - start


def stream_rtf(tl: RequestTimeline) -> float:
    """The real-time factor of one stream after its first chunk (0 with fewer than two)."""
    chunks = tl.audio_chunks
    rate = tl.sample_rate or 24000
    if len(chunks) < 2:
        return 0.0
    after_first = sum(c.num_samples for c in chunks[1:]) / rate
    return (chunks[-1].at_s - chunks[0].at_s) / after_first if after_first > 0 else 0.0


def step_times(timelines: list[RequestTimeline]) -> dict[str, dict[str, float]]:
    """p50/p99/mean wall time of each stage's executor calls seen by these requests."""
    steps: dict[int, dict[float, float]] = {}
    for tl in timelines:
        for event in tl.events:
            if event.step is not None:
                steps.setdefault(event.stage_id, {})[event.step.start_s] = event.step.wall_s
    return {
        str(sid): {**_summary(list(by_start.values())), "count": len(by_start)}
        for sid, by_start in sorted(steps.items())
    }


def _worst_streams(timelines: list[RequestTimeline], limit: int = 4) -> list[dict[str, Any]]:
    """The streams with the longest gaps: where the gap fell and their first chunks
    (arrival ms, audio ms), to tell a slow first chunk from a stall mid-stream."""
    gapped = sorted((t for t in timelines if t.playback.num_underruns), key=lambda t: -t.playback.worst_gap_s)
    rate = 24000
    out = []
    for t in gapped[:limit]:
        pb = t.playback
        chunks = t.audio_chunks[:16]
        out.append(
            {
                "worst_gap_ms": round(pb.worst_gap_s * 1000, 1),
                "worst_gap_at": pb.worst_gap_at,
                "num_gaps": pb.num_underruns,
                "first_chunks_ms": [
                    [round(c.at_s * 1000, 1), round(1000 * c.num_samples / (t.sample_rate or rate), 1)]
                    for c in chunks
                ],
            }
        )
    return out


def _level_report(
    concurrency: int, timelines: list[RequestTimeline], wall_s: float, holdback: int
) -> dict[str, Any]:
    ttfa = [t.ttfa_s for t in timelines if t.ttfa_s is not None]
    fa = [t.cp_first_audio for t in timelines if t.cp_first_audio is not None]
    ends = [t.cp_done for t in timelines if t.cp_done is not None]
    segments = {name: statistics.fmean(cp.segments[name] for cp in fa) for name in SEGMENTS} if fa else {}
    rtfs = [stream_rtf(t) for t in timelines]
    heard = [t.playback for t in timelines if t.audio_chunks]
    gap_free = sum(1 for p in heard if p.is_gap_free)
    frames_ok = all(
        t.num_frames is not None and t.num_samples == t.num_frames * SAMPLES_PER_FRAME - holdback
        for t in timelines
    )
    return {
        "concurrency": concurrency,
        "num_requests": len(timelines),
        "wall_s": wall_s,
        "requests_per_s": len(timelines) / wall_s if wall_s > 0 else 0.0,
        "ttfa_s": _summary(ttfa),
        "ttft_s": _summary([t.ttft_s for t in timelines if t.ttft_s is not None]),
        "e2e_s": _summary([t.total_s for t in timelines]),
        "overhead_first_audio_s": _summary([cp.overhead_s for cp in fa]),
        "overhead_first_audio_share": _summary([cp.overhead_share for cp in fa]),
        "compute_first_audio_s": _summary([cp.compute_s for cp in fa]),
        "overhead_done_s": _summary([cp.overhead_s for cp in ends]),
        "overhead_done_share": _summary([cp.overhead_share for cp in ends]),
        "overhead_first_audio_segments_mean_s": segments,
        "audio_s": _summary([t.num_samples / (t.sample_rate or 24000) for t in timelines]),
        "is_audio_length_exact": frames_ok,
        "first_playable_s": _summary([p.first_playable_s for p in heard if p.first_playable_s is not None]),
        "worst_gap_s": _summary([p.worst_gap_s for p in heard]),
        "silence_s": _summary([p.silence_s for p in heard]),
        "num_streams": len(heard),
        "num_gap_free_streams": gap_free,
        "gap_free_share": gap_free / len(heard) if heard else 0.0,
        "num_stalled_streams": sum(1 for p in heard if p.num_underruns),
        "worst_streams": _worst_streams(timelines),
        "rtf": _summary(rtfs),
        "step_s": step_times(timelines),
    }


def run_pipeline_bench(
    *,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    requests: int | None = None,
    warmup: int = 2,
    prompt: str = DEFAULT_PROMPT,
    pipeline: str | None = None,
    device: str | None = None,
    load_format: str | None = None,
    runner: str | None = None,
    timeout_s: float = 600.0,
    stream: TextIO | None = None,
    mps: bool = False,
    schedule: str = "adaptive",
    max_audio_streams: int | None = None,
    device_groups: str | None = None,
) -> dict[str, Any]:
    """Start ``pipeline`` (default ``qwen3-omni-tiny``; the full-size ``qwen3-omni``
    with ``load_format="dummy"``; ``device``/``load_format``/``runner`` as in
    :func:`~omnirelay.cli.session.load_run_config`), run :func:`bench_running_pipeline` on
    it, shut it down and add the shutdown to the audit. Progress goes to ``stream``.
    ``mps``: the whole run under a private MPS daemon (:func:`benchmarks.mps.mps_daemon`).
    ``schedule``: one of :data:`SCHEDULES`; with ``both`` the report is the adaptive
    schedule's and ``report["fixed_schedule"]`` the fixed one's, measured after it.
    ``max_audio_streams``: the pipeline's real-time capacity for this run (None: the
    file's); requests past it wait for a stream, and that wait counts in their figures.
    ``device_groups`` (``auto``, ``on``, ``off``) overrides the pipeline's (docs/design.md
    §12); under ``mps`` it defaults to ``off``: a process per stage, which MPS shares."""
    _check_options(concurrency, requests, warmup)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    daemon: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if mps:
        from benchmarks.mps import mps_daemon

        daemon = mps_daemon()
        device_groups = device_groups or "off"
    with daemon:
        report = _run_schedules(
            schedule,
            max_audio_streams,
            concurrency,
            requests,
            warmup,
            prompt,
            pipeline,
            device,
            load_format,
            runner,
            timeout_s,
            stream,
            device_groups=device_groups,
        )
    report["mps"] = mps
    return report


def _run_schedules(
    schedule: str, max_audio_streams: int | None, *args: Any, device_groups: str | None
) -> dict[str, Any]:
    first = "fixed" if schedule == "fixed" else "adaptive"
    report = _run_pipeline_bench(first, max_audio_streams, *args, device_groups=device_groups)
    if schedule == "both":
        fixed = _run_pipeline_bench("fixed", max_audio_streams, *args, device_groups=device_groups)
        report["fixed_schedule"] = fixed
        report["ok"] = report["ok"] and fixed["ok"]
    return report


def with_codec_schedule(config: Any, schedule: str) -> Any:
    """``config`` with its Talker → Code2Wav edges on ``schedule``: ``adaptive`` leaves
    the file's own settings, ``fixed`` sets the seed's (:data:`FIXED_SCHEDULE`, and the
    Code2Wav stages decode window by window: ``executor_args.stateful: false``)."""
    import msgspec

    if schedule == "adaptive":
        return config
    consumers = {
        consumer
        for stage in config.stages
        if stage.chunk_processor == "talker_to_code2wav"
        for consumer in config.consumer_ids(stage)
    }
    names = {config.input_connector(consumer) for consumer in consumers}
    connectors = {
        name: msgspec.structs.replace(spec, extra={**spec.extra, **FIXED_SCHEDULE}) if name in names else spec
        for name, spec in config.connectors.items()
    }
    stages = tuple(
        msgspec.structs.replace(s, executor_args={**s.executor_args, "stateful": False})
        if s.id in consumers
        else s
        for s in config.stages
    )
    return msgspec.structs.replace(config, connectors=connectors, stages=stages)


def _run_pipeline_bench(
    schedule: str,
    max_audio_streams: int | None,
    concurrency: Sequence[int],
    requests: int | None,
    warmup: int,
    prompt: str,
    pipeline: str | None,
    device: str | None,
    load_format: str | None,
    runner: str | None,
    timeout_s: float,
    stream: TextIO | None,
    *,
    device_groups: str | None = None,
) -> dict[str, Any]:
    from omnirelay.pipeline.groups import process_groups

    err = stream if stream is not None else sys.stderr
    if pipeline is None and load_format != "dummy":
        pipeline = "qwen3-omni-tiny"  # the protocol's test bed: codec frames on every edge
    config = with_codec_schedule(
        load_run_config(pipeline, device=device, load_format=load_format, runner=runner), schedule
    )
    if device_groups is not None:
        config = config.with_device_groups(device_groups)
    if max_audio_streams is not None:
        import msgspec

        config = msgspec.structs.replace(config, max_audio_streams=max_audio_streams)
    err.write(f"chunk schedule: {schedule}\n")
    from omnirelay.models import encode_chat_prompt

    prompt_ids = encode_chat_prompt(open_tokenizer(config, err), prompt)
    trace = StageTrace()
    pipe, startup_s = start_pipeline(config, on_stage_output=trace, trace_steps=True, stream=err)
    try:
        report = bench_running_pipeline(
            pipe,
            trace,
            prompt_ids,
            concurrency=concurrency,
            requests=requests,
            warmup=warmup,
            timeout_s=timeout_s,
            stream=err,
        )
        report["stage_slots"] = _stage_slots(pipe)
    finally:
        shutdown = pipe.shutdown()
    report.update(
        prompt=prompt,
        schedule=schedule,
        max_audio_streams=config.max_audio_streams,
        codec_schedule={
            name: dict(spec.extra)
            for name, spec in config.connectors.items()
            if any("codec_" in k for k in spec.extra)
        },
        startup_s=startup_s,
        stage_args={s.name: dict(s.executor_args) for s in config.stages},
        stage_env={s.name: s.process_env() for s in config.stages},
        device_groups=config.device_groups.value,
        processes=[
            [config.stages[config.workers()[i].stage_id].name for i in g] for g in process_groups(config)
        ],
    )
    report["audit"].update(
        shutdown_killed=shutdown.num_killed, shutdown_objects_left=shutdown.num_objects_left
    )
    report["ok"] = report["ok"] and not (shutdown.num_killed or shutdown.num_objects_left)
    return report


def _stage_slots(pipe: Any) -> dict[str, int]:
    """Requests each stage runs at once, by its worker's scheduler (a stage whose KV
    slots were sized from the device memory reports what fit)."""
    slots: dict[str, int] = {}
    for stage in pipe.health().stages:
        limit = ((stage.engine or {}).get("scheduler") or {}).get("max_num_seqs")
        if isinstance(limit, int):
            slots[stage.name] = limit
    return slots


def _check_options(concurrency: Sequence[int], requests: int | None, warmup: int) -> None:
    if not concurrency or any(int(c) < 1 for c in concurrency):
        raise ValueError(f"concurrency levels must be >= 1, got {list(concurrency)}")
    if requests is not None and requests < 1:
        raise ValueError(f"--requests must be >= 1, got {requests}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")


def bench_running_pipeline(
    pipe: Pipeline,
    trace: StageTrace,
    prompt_ids: list[int],
    *,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    requests: int | None = None,
    warmup: int = 2,
    timeout_s: float = 600.0,
    stream: TextIO | None = None,
) -> dict[str, Any]:
    """The measurement on a running pipeline (started with ``on_stage_output=trace,
    trace_steps=True``);
    ``requests`` per level (default ``max(8, 2 * concurrency)``). Ends with a leak audit
    of the stages and the namespace; the pipeline keeps running."""
    from omnirelay.connectors.shm import sweep
    from omnirelay.worker import leak_paths

    _check_options(concurrency, requests, warmup)
    err = stream if stream is not None else sys.stderr
    config = pipe.config
    report: dict[str, Any] = {
        "pipeline": config.name,
        "num_prompt_tokens": len(prompt_ids),
        "warmup": warmup,
        "target": {"overhead_share_of_ttfa_at_concurrency_1": OVERHEAD_TARGET, "judged_on": "p50"},
        "levels": [],
        "env": {
            "python": platform.python_version(),
            "interpreter": interpreter_info().to_dict(),
            "torch": torch.__version__,
            "cpus": len(os.sched_getaffinity(0)),
            "loadavg_start": os.getloadavg(),
            "gpus": _gpu_names(),
            "commit": _commit(),
        },
    }
    for i in range(warmup):
        err.write(f"warm-up request {i + 1}/{warmup}\n")
        drive_request(pipe, trace, prompt_ids, modalities=["text", "audio"])
    holdback = _decoder_holdback(config)
    for c in (int(c) for c in concurrency):
        n = requests if requests is not None else max(8, 2 * c)
        err.write(f"concurrency {c}: {n} requests\n")
        err.flush()
        timelines, wall_s = _run_level(pipe, trace, prompt_ids, c, n, timeout_s)
        report["levels"].append(_level_report(c, timelines, wall_s, holdback))
    leaks = {sid: leak_paths(state) for sid, state in pipe.leak_state().items()}
    # Free pooled slots are reusable memory of live producers, holding no key.
    objects = [o.name for o in sweep(pipe.namespace).objects if not (o.kind == "slot" and o.state == "free")]
    report["audit"] = {
        "stage_state_left": {str(k): v for k, v in leaks.items() if v},
        "transfer_objects_left": objects,
        "traces_left": trace.num_watched,
    }
    report["env"]["loadavg_end"] = os.getloadavg()
    report["decoder_holdback_samples"] = holdback
    report["ok"] = not (objects or report["audit"]["stage_state_left"] or trace.num_watched)
    return report


def _gpu_names() -> list[str]:
    """The GPUs' names, from ``nvidia-smi`` where it runs: this process then creates no
    CUDA context of its own (under MPS a context would be one more client keeping the
    daemon up after the run)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0:
            return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _commit() -> str | None:
    """The git commit of the checkout this benchmark runs from (None outside one; a copy
    of a checkout without its ``.git`` can name it in ``OMNIRELAY_BENCH_COMMIT``)."""
    import subprocess
    from pathlib import Path

    if os.environ.get("OMNIRELAY_BENCH_COMMIT"):
        return os.environ["OMNIRELAY_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _decoder_holdback(config: Any) -> int:
    """Samples the Code2Wav decoder holds back at the end of a window (docs/protocol.md §6.2 ``tail``):
    the whole stream is ``frames * 1920 - holdback`` samples long. Measured on the CPU
    with a short decode of the audio stage's decoder (its weights do not matter)."""
    from omnirelay.models.code2wav import decoder_holdback
    from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint

    stage = next(s for s in config.stages if str(s.final_output_type) == "audio")
    args = ModelArgs.from_executor_args({**stage.executor_args, "device": "cpu", "load_format": "dummy"})
    return decoder_holdback(open_checkpoint(args).load_code2wav())


def target_met(report: dict[str, Any]) -> bool | None:
    """Overhead ≤ 10% of TTFA at concurrency 1 (median request); None if 1 was not run."""
    for level in report["levels"]:
        if level["concurrency"] == 1:
            return bool(level["overhead_first_audio_share"]["p50"] <= OVERHEAD_TARGET)
    return None


def is_gpu_run(report: dict[str, Any]) -> bool:
    """Whether a model stage of the measured pipeline ran on CUDA (the TTFA targets are
    those of the full-size model on a GPU)."""
    return any(
        str(args.get("device", "")).startswith("cuda") for args in (report.get("stage_args") or {}).values()
    )


def audio_targets_met(report: dict[str, Any]) -> dict[int, bool]:
    """Per measured level with a target: first playable audio p50 within
    :data:`PLAYABLE_TARGETS_S` and at least :data:`GAP_FREE_TARGETS` of the streams
    gap-free. Empty off a GPU (the targets are the full-size model's on one H200)."""
    if not is_gpu_run(report):
        return {}
    return {
        lv["concurrency"]: bool(
            lv["first_playable_s"]["p50"] <= PLAYABLE_TARGETS_S[lv["concurrency"]]
            and lv["gap_free_share"] >= GAP_FREE_TARGETS[lv["concurrency"]]
        )
        for lv in report["levels"]
        if lv["concurrency"] in PLAYABLE_TARGETS_S
    }


def render_playback(report: dict[str, Any]) -> str:
    """What a listener hears, per level: first audio, first playable audio, gaps."""

    def ms(v: float) -> str:
        return f"{v * 1000:,.0f}"

    lines = [
        "what a listener hears (ms; a player that starts at the first audio):\n",
        f"{'conc':>4} | {'first audio':^15} | {'first playable':^15} | {'worst gap':^15} | "
        f"{'silence':^15} | {'gap-free':>14}\n",
        f"{'':>4} | {'p50':>7} {'p99':>7} | {'p50':>7} {'p99':>7} | {'p50':>7} {'p99':>7} | "
        f"{'p50':>7} {'p99':>7} |\n",
    ]
    for lv in report["levels"]:
        row = [f"{lv['concurrency']:>4} "]
        for key in ("ttfa_s", "first_playable_s", "worst_gap_s", "silence_s"):
            row.append(f"| {ms(lv[key]['p50']):>7} {ms(lv[key]['p99']):>7} ")
        share = f"{lv['num_gap_free_streams']}/{lv['num_streams']} {lv['gap_free_share']:.0%}"
        lines.append("".join(row) + f"| {share:>14}\n")
    for conc, ok in audio_targets_met(report).items():
        lv = next(x for x in report["levels"] if x["concurrency"] == conc)
        lines.append(
            f"target at concurrency {conc}: first playable p50 <= {PLAYABLE_TARGETS_S[conc] * 1000:,.0f} ms, "
            f">= {GAP_FREE_TARGETS[conc]:.0%} gap-free: {ms(lv['first_playable_s']['p50'])} ms, "
            f"{lv['gap_free_share']:.1%} — {'met' if ok else 'MISSED'}\n"
        )
    return "".join(lines)


def render_streams(report: dict[str, Any]) -> str:
    """Real-time factor, streams with gaps, and each stage's step times."""
    names = list(report.get("stage_args") or {})
    stages = sorted({sid for lv in report["levels"] for sid in lv["step_s"]}, key=int)
    label = {sid: names[int(sid)] if int(sid) < len(names) else f"stage {sid}" for sid in stages}
    head = "".join(f"{label[sid] + ' p50/p99':>22}" for sid in stages)
    lines = [
        "streams and steps (ms):\n",
        f"{'conc':>4} {'RTF p50':>8} {'RTF max':>8} {'gaps':>8}{head}\n",
    ]
    for lv in report["levels"]:
        steps = "".join(
            f"{lv['step_s'][sid]['p50'] * 1000:>12.1f}/{lv['step_s'][sid]['p99'] * 1000:<9.1f}"
            if sid in lv["step_s"]
            else f"{'-':>22}"
            for sid in stages
        )
        lines.append(
            f"{lv['concurrency']:>4} {lv['rtf']['p50']:>8.3f} {lv['rtf']['max']:>8.3f} "
            f"{lv['num_stalled_streams']:>8}{steps}\n"
        )
    return "".join(lines)


def render_pipeline_bench(report: dict[str, Any]) -> str:
    """The tables ``omnirelay bench pipeline`` prints (both schedules' with ``both``)."""
    text = _render_one(report)
    if "fixed_schedule" in report:
        text += "\n" + _render_one(report["fixed_schedule"])
    return text


def _render_one(report: dict[str, Any]) -> str:
    def ms(v: float) -> str:
        return f"{v * 1000:,.1f}"

    startup = f"; ready to serve in {report['startup_s']:.1f} s" if "startup_s" in report else ""
    gpus = f"; {', '.join(report['env'].get('gpus') or [])}" if report["env"].get("gpus") else ""
    lines = [
        f"omnirelay bench pipeline: {report['pipeline']}{gpus}{startup}\n",
        f"chunk schedule: {report.get('schedule', 'adaptive')}; audio streams at once: "
        f"{report.get('max_audio_streams') or 'no fixed limit'}"
        + (
            "; requests at once per stage: " + ", ".join(f"{k} {v}" for k, v in report["stage_slots"].items())
            if report.get("stage_slots")
            else ""
        )
        + "\n",
        f"{report['num_prompt_tokens']}-token prompt, "
        f"text+audio; {report['warmup']} warm-up request(s) not counted; "
        f"{report['env']['cpus']} CPUs, load average {report['env']['loadavg_start'][0]:.2f} at start\n",
        "\n",
        f"{'':>16}| {'TTFA (ms)':^17} | {'overhead to FA (ms)':^19} | {'share of TTFA':^15} | "
        f"{'end to end':^22}\n",
        f"{'conc':>4} {'reqs':>4} {'req/s':>5} | {'p50':>8} {'p99':>8} | {'p50':>9} {'p99':>9} | "
        f"{'p50':>7} {'p99':>7} | {'p50 ms':>10} {'overhead':>11}\n",
    ]
    for lv in report["levels"]:
        lines.append(
            f"{lv['concurrency']:>4} {lv['num_requests']:>4} {lv['requests_per_s']:>5.2f} | "
            f"{ms(lv['ttfa_s']['p50']):>8} {ms(lv['ttfa_s']['p99']):>8} | "
            f"{ms(lv['overhead_first_audio_s']['p50']):>9} {ms(lv['overhead_first_audio_s']['p99']):>9} | "
            f"{lv['overhead_first_audio_share']['p50']:>7.1%} {lv['overhead_first_audio_share']['p99']:>7.1%} | "
            f"{ms(lv['e2e_s']['p50']):>10} {lv['overhead_done_share']['p50']:>11.1%}\n"
        )
    lines.append("\n")
    lines.append("overhead to first audio by kind (mean µs per request):\n")
    header = "".join(f"{name.replace('_', ' '):>14}" for name in SEGMENTS)
    lines.append(f"{'conc':>4}{header}\n")
    for lv in report["levels"]:
        seg = lv["overhead_first_audio_segments_mean_s"]
        lines.append(
            f"{lv['concurrency']:>4}" + "".join(f"{seg.get(n, 0.0) * 1e6:>14,.0f}" for n in SEGMENTS) + "\n"
        )
    lines.append("\n")
    lines.append(render_playback(report))
    lines.append("\n")
    lines.append(render_streams(report))
    lines.append("\n")
    met = target_met(report)
    if met is None:
        lines.append("target: overhead <= 10% of TTFA at concurrency 1 — not measured (no level 1)\n")
    else:
        share = next(lv for lv in report["levels"] if lv["concurrency"] == 1)["overhead_first_audio_share"][
            "p50"
        ]
        verdict = "met" if met else "MISSED"
        lines.append(
            f"target: overhead <= 10% of TTFA at concurrency 1 (median request): {share:.1%} — {verdict}\n"
        )
    exact = all(lv["is_audio_length_exact"] for lv in report["levels"])
    lines.append(
        f"audio length = codec frames x {SAMPLES_PER_FRAME} - {report['decoder_holdback_samples']} "
        "(decoder hold-back) "
        f"for every request: {'yes' if exact else 'NO'}\n"
    )
    audit = report["audit"]
    clean = report["ok"]
    lines.append(
        "leak audit: "
        + (
            "clean (no stage state, no transfer objects"
            + (", clean shutdown)" if "shutdown_killed" in audit else ")")
            if clean
            else f"LEAKS {audit}"
        )
        + "\n"
    )
    return "".join(lines)
