"""The benchmarks' command line: ``omnirelay bench BENCH ...`` (or ``python -m benchmarks BENCH ...``).

:func:`main` parses the arguments after ``bench`` and runs one benchmark: ``transfer``,
``stress``, ``adapter``, ``pipeline``, ``runner``, ``tts-talker``, ``serve``, ``speech`` or ``chaos``. Each prints its table, writes its
figures with ``--json PATH`` and returns the exit status (1 when a target is missed or
something leaked). ``omnirelay bench`` (:mod:`omnirelay.cli.bench`) imports this module
only when a benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

N = TypeVar("N", int, float)

__all__ = ["build_parser", "main"]

#: Targets of the connector issue, checked and printed by ``bench transfer``.
TRANSFER_TARGETS_US = {"codec_chunk": 60.0, "prefill_4mb": 2500.0, "tensor_64mb": 60000.0}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``omnirelay bench``: one sub-command per benchmark."""
    p = argparse.ArgumentParser(
        prog="omnirelay bench",
        description="Run a benchmark (from a source checkout: the benchmarks/ package).",
    )
    _register_benches(p.add_subparsers(dest="bench", metavar="BENCH"))

    def no_bench(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=no_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark named in ``argv`` (the arguments after ``omnirelay bench``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chaos"]:  # its own parser, --help included
        from benchmarks.chaos import main as chaos_main

        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    status = int(args.func(args) or 0)
    end_if_cuda(status)
    return status


def end_if_cuda(status: int) -> None:
    """A bench that ran CUDA graphs in this process ends as a stage worker does, with
    ``os._exit(status)`` once its output is flushed: at interpreter exit the collection
    faults in the destructors of what the graph sets left (exit status 139 after the
    figures were written). A bench that never started CUDA returns normally."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _register_benches(bsub: Any) -> None:

    t = bsub.add_parser(
        "transfer",
        help="connector latency/throughput across processes vs. the memcpy limit and a pickle baseline",
        description=(
            "Moves a codec chunk (int64 16x50 + meta), a bf16 1x2048 hidden step, a 4 MB f32 prefill "
            "and a 64 MB tensor from a producer process to a consumer process through the shm "
            "connector, and through a pickle-over-multiprocessing.shared_memory baseline. Prints "
            "one-way latency p50/p99 and stream throughput side by side with the physical limit "
            "(two memcpy of the same bytes, measured in the same run)."
        ),
    )
    t.add_argument(
        "--payloads",
        default=None,
        help="comma-separated subset of: codec_chunk,hidden_step,prefill_4mb,tensor_64mb",
    )
    t.add_argument(
        "--scale", type=float, default=1.0, help="multiply the number of trials (e.g. 0.1 for a quick run)"
    )
    t.add_argument("--no-baseline", action="store_true", help="skip the pickle baseline")
    t.add_argument(
        "--backend",
        choices=("shm", "nixl"),
        default="shm",
        help=(
            "shm (default): the one-host rows above. nixl: the cross-host connector over TCP "
            "(UCX_TLS=tcp, loopback) beside shm and a pickle-over-ZeroMQ-TCP baseline, in one run "
            "(codec chunk, 4 MB, 64 MB unless --payloads says otherwise)"
        ),
    )
    t.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin producer and consumer to two CPUs (default: pinned, like transfer_anchor.py --pin)",
    )
    t.add_argument(
        "--gpu",
        metavar="DEVICES",
        default=None,
        help=(
            "GPU -> GPU rows instead: cuda:0 (producer and consumer on one GPU) or cuda:0,cuda:1 (and a "
            "peer pair); each payload through the host path and the GPU-direct path (CUDA IPC)"
        ),
    )
    t.add_argument("--json", metavar="PATH", help="write all figures as JSON to PATH")
    t.set_defaults(func=run_bench_transfer)

    s = bsub.add_parser(
        "stress",
        help="cross-process transfers with cancellations, id reuse and early-stopping consumers; ends with a leak audit",
        description=(
            "Producer and consumer processes move >= 5,000 chunks over >= 500 requests through the "
            "chunk transfer adapter, cancelling >= 10% of requests at random points, reusing ids after "
            "cancel, stopping consumers early, mixing codec-sized and 4 MB chunks; then audits for leaks."
        ),
    )
    s.add_argument("--requests", type=int, default=600, help="number of requests (default 600)")
    s.add_argument("--chunks", type=int, default=10, help="chunks per request (default 10)")
    s.add_argument(
        "--cancel-fraction", type=float, default=0.15, help="fraction of requests cancelled (default 0.15)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--timeout", type=float, default=600.0, help="bound on the whole run in seconds (default 600)"
    )
    s.add_argument("--json", metavar="PATH", help="write the counts and the audit as JSON to PATH")
    s.set_defaults(func=run_bench_stress)

    a = bsub.add_parser(
        "adapter",
        help="the transfer adapter's own cost per codec chunk across processes, and head-of-line blocking",
        description=(
            "Sender (stage 1) and receiver (stage 2) processes, one codec chunk (int64 16x50 + meta) in "
            "flight: (a) save_async on the sender -> chunk published ready on the receiver (and handed to "
            "its scheduler by poll_events), "
            "interleaved with the raw shm connector's one-way latency (put -> get) so the adapter's "
            "overhead is visible; (b) the same codec chunks without and with another request streaming "
            "64 MB payloads. Prints p50/p99/max against the targets (p50 <= 150 us; <= 5 ms added by the "
            "64 MB stream). The sender is pinned to the first CPU this process may use and the receiver "
            "to the second, as in bench transfer (--no-pin lets the scheduler place them). "
            "The report names the Python build that ran it: the hot paths are interpreted, so "
            "an unoptimized build (see omnirelay doctor) makes every figure slower."
        ),
    )
    a.add_argument("--chunks", type=int, default=1000, help="measured chunks per series (default 1000)")
    a.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the sender and receiver processes to two CPUs",
    )
    a.add_argument(
        "--warmup", type=int, default=100, help="unmeasured chunks before each series (default 100)"
    )
    a.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the whole benchmark N times and judge the targets on the medians of the runs "
        "(a shared machine's speed varies from minute to minute; default 1)",
    )
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--timeout", type=float, default=600.0, help="bound on each run in seconds")
    a.add_argument("--json", metavar="PATH", help="write all figures as JSON to PATH")
    a.set_defaults(func=run_bench_adapter)

    q = bsub.add_parser(
        "pipeline",
        help="Qwen3-Omni pipeline: time to first audio, real-time factor and runtime overhead per concurrency",
        description=(
            "Runs text+audio chat requests through the real multi-process qwen3-omni-tiny pipeline "
            "(tiny seeded models, shm connector), keeping C requests in flight for each concurrency "
            "level C. Per request: time to first audio (TTFA), first playable audio (the earliest "
            "moment a player could start and never run dry), the gaps a player starting at the first "
            "audio hears (worst gap, total silence; gap-free: worst gap <= 50 ms), and the runtime "
            "overhead: wall time on "
            "the critical path to the first audio (and to the last output) minus the model compute on "
            "that path, as a share of TTFA (and of the end-to-end time). Prints p50/p99 per level, the "
            "overhead split by kind (control plane, transfers, scheduling, delivery) and the target: "
            "overhead <= 10% of TTFA at concurrency 1 (median request); on a GPU also first playable "
            "audio p50 <= 150 ms / 400 ms / 1.0 s at concurrency 1 / 16 / 64 with 100% / 99% / 99% of the "
            "streams gap-free. Warm-up requests are not "
            "counted; the run ends with a leak audit. Exit status 1 if the target is missed or "
            "something leaked."
        ),
    )
    q.add_argument(
        "--concurrency",
        default="1,4,16",
        help="comma-separated concurrency levels (default 1,4,16)",
    )
    q.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level (default: max(8, 2 x concurrency))",
    )
    q.add_argument(
        "--pipeline",
        default=None,
        help="a shipped pipeline name or a YAML file (default qwen3-omni-tiny; with --load-format dummy: qwen3-omni)",
    )
    q.add_argument("--device", default=None, help="torch device of every Qwen3-Omni stage (cpu, cuda:0)")
    q.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: random weights from the config alone (the full-size model needs no checkpoint)",
    )
    q.add_argument(
        "--runner",
        choices=("auto", "dynamic", "static"),
        default=None,
        help="model runner of the Qwen3-Omni stages (dynamic: the eager transformers path, for a baseline)",
    )
    q.add_argument(
        "--mps",
        action="store_true",
        help=(
            "run the stages under a private CUDA MPS daemon started for this run and stopped after it "
            "(their kernels share the GPU at once instead of in time slices; a stage's gpu_share and "
            "gpu_priority act only under MPS; a process per stage unless --device-groups says otherwise)"
        ),
    )
    q.add_argument(
        "--device-groups",
        choices=("auto", "on", "off"),
        default=None,
        help="which stages share a worker process: auto (the stages on one CUDA device), off (a process "
        "per stage), on (also the CPU stages); default: the pipeline file's device_groups, else auto",
    )
    q.add_argument(
        "--schedule",
        choices=("adaptive", "fixed", "both"),
        default="adaptive",
        help=(
            "the Talker -> Code2Wav chunk schedule: adaptive (the pipeline file's, the default), fixed "
            "(the seed's: 4 frames, then 25), or both, one after the other in this run"
        ),
    )
    q.add_argument(
        "--max-audio-streams",
        type=int,
        default=None,
        metavar="N",
        help="the pipeline's real-time capacity for this run: requests for audio past N wait for a "
        "stream, and the wait counts in their figures (default: the pipeline file's)",
    )
    q.add_argument("--warmup", type=int, default=2, help="uncounted warm-up requests first (default 2)")
    q.add_argument("--prompt", default="Hello, who are you?", help="the chat prompt of every request")
    q.add_argument(
        "--timeout", type=float, default=600.0, help="bound on each level in seconds (default 600)"
    )
    q.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    q.set_defaults(func=run_bench_pipeline)

    r = bsub.add_parser(
        "runner",
        help="GPU: each full-size stage's step time, eager vs CUDA graphs (dummy weights)",
        description=(
            "Builds the full-size Qwen3-Omni Thinker, Talker and Code2Wav with random weights on a CUDA "
            "device (one at a time) and times their steps on the static runner, eagerly and replayed from "
            "CUDA graphs: Thinker prefill (1/16/64 prompts) and decode (1/16/64 rows), Talker prefill and "
            "whole frames (1/16/64 rows) with the code-predictor tail eager and compiled, Code2Wav windows "
            "and stateful streaming steps. Also reports capture and compile times and whether eager and "
            "graph greedy outputs agree."
        ),
    )
    r.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    r.add_argument(
        "--stages",
        default="thinker,talker,code2wav",
        help="comma-separated stages to time (default all: thinker,talker,code2wav)",
    )
    r.add_argument("--reps", type=int, default=20, help="timed runs per figure (default 20)")
    r.add_argument(
        "--no-compiled-code2wav",
        dest="code2wav_compiled",
        action="store_false",
        help="time Code2Wav's stream steps uncompiled only (inductor's compile of a full-size step can take minutes)",
    )
    r.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    r.set_defaults(func=run_bench_runner)

    tt = bsub.add_parser(
        "tts-talker",
        help="where a Qwen3-TTS Talker step's time goes, by batch (frame, tail, admitting a request)",
        description=(
            "Builds the Qwen3-TTS Talker stage as the pipeline does (random weights of a shipped config, or "
            "the tiny model) alone on a device and times, per batch of continuing requests: the Talker's "
            "frame step, the whole step (the code-predictor tail over every row, host work and the codes' "
            "copy included) and a step that admits one new request. --profile B adds the kernels per step "
            "and the largest kernels at batch B (torch.profiler)."
        ),
    )
    tt.add_argument("--model", default="1.7b-customvoice", help="shipped config (default 1.7b-customvoice)")
    tt.add_argument("--device", default="cuda:0", help="torch device (default cuda:0)")
    tt.add_argument(
        "--load-format",
        choices=("dummy", "tiny"),
        default="dummy",
        help="dummy: random weights of the shipped config (default); tiny: the tiny model",
    )
    tt.add_argument(
        "--batches", default="1,8,16,32,48,64", help="comma-separated batch sizes (default 1,8,16,32,48,64)"
    )
    tt.add_argument("--reps", type=int, default=20, help="timed runs per figure (default 20)")
    tt.add_argument(
        "--prefill-tokens", type=int, default=64, help="a new request's prefill rows (default 64)"
    )
    tt.add_argument("--profile", type=int, default=None, metavar="B", help="profile the steps at batch B")
    tt.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    tt.set_defaults(func=run_bench_tts_talker)

    v = bsub.add_parser(
        "serve",
        help="load generator for the OpenAI-compatible server: TTFA, real-time factor, requests/s",
        description=(
            "Sends streaming POST /v1/audio/speech requests (wav) to a server, keeping C requests in "
            "flight for each concurrency level C, and prints per level: time to first audio p50/p99, "
            "real-time factor (audio seconds received / wall seconds, and per request end-to-end time "
            "/ audio duration), requests/s and errors. Without --url it starts the pipeline and a server "
            "on 127.0.0.1 (a free port), and stops both at the end after a leak audit. Only loopback "
            "servers are driven. Exit status 1 if a level had no successful request or something leaked."
        ),
    )
    v.add_argument(
        "--pipeline",
        default="qwen3-omni-tiny",
        help="the pipeline to start when no --url is given (default qwen3-omni-tiny)",
    )
    v.add_argument(
        "--url", default=None, help="a running server on a loopback address, e.g. http://127.0.0.1:8000"
    )
    v.add_argument(
        "--concurrency", default="1,8,32", help="comma-separated concurrency levels (default 1,8,32)"
    )
    v.add_argument(
        "--requests", type=int, default=None, help="requests per level (default: max(8, 2 x concurrency))"
    )
    v.add_argument("--warmup", type=int, default=1, help="uncounted warm-up requests first (default 1)")
    v.add_argument("--text", default=None, help="the input of every speech request")
    v.add_argument(
        "--voice",
        default="alloy",
        help="the voice of every request (default alloy: an OpenAI name every shipped pipeline maps)",
    )
    v.add_argument(
        "--timeout", type=float, default=300.0, help="bound on each level in seconds (default 300)"
    )
    v.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    v.set_defaults(func=run_bench_serve)

    sp = bsub.add_parser(
        "speech",
        help="text-to-speech under open-loop Poisson arrivals: first playable audio, gap-free streams, RTF",
        description=(
            "Submits speech requests to the real multi-process pipeline (default qwen3-tts) at the times "
            "of a seeded Poisson process of each given rate (open loop: arrivals do not wait for the "
            "pipeline), for --duration seconds of arrivals, and prints per rate: first playable audio "
            "p50/p95/p99 (the earliest moment a player could start and never run dry), first audio, the "
            "share of streams whose worst gap is <= 50 ms, the real-time factor, requests/s and audio "
            "seconds per second. Targets (one GPU, judged only when a model stage runs on CUDA): first "
            "playable audio p50 <= 100 ms at 1/s and <= 150 ms at 20/s, >= 99% of streams gap-free. Ends "
            "with a leak audit; exit status 1 if a target is missed or something leaked."
        ),
    )
    sp.add_argument(
        "--pipeline", default="qwen3-tts", help="a shipped pipeline name or a YAML file (default qwen3-tts)"
    )
    sp.add_argument("--device", default=None, help="torch device of the model stages (cuda:0, cpu)")
    sp.add_argument(
        "--load-format",
        choices=("auto", "dummy", "tiny"),
        default=None,
        help="dummy: random weights of the shipped config (no checkpoint); tiny: the tiny model",
    )
    sp.add_argument("--rates", default="1,20", help="comma-separated request rates per second (default 1,20)")
    sp.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (default 60)")
    sp.add_argument("--requests", type=int, default=None, help="requests per rate (default: rate x duration)")
    sp.add_argument("--warmup", type=int, default=4, help="uncounted warm-up requests first (default 4)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default 0)")
    sp.add_argument(
        "--max-frames",
        type=int,
        default=None,
        help="codec frames of every request (default: the length of speech its text needs)",
    )
    sp.add_argument(
        "--timeout", type=float, default=900.0, help="bound on each rate in seconds (default 900)"
    )
    sp.add_argument(
        "--mps",
        action="store_true",
        help=(
            "run the stages under a private CUDA MPS daemon started for this run and stopped after it "
            "(the Talker's and Code2Wav's kernels share the GPU at once instead of in time slices; "
            "a process per stage unless --device-groups says otherwise)"
        ),
    )
    sp.add_argument(
        "--device-groups",
        choices=("auto", "on", "off"),
        default=None,
        help=(
            "which stages share a worker process: auto (the stages on one CUDA device), off (a process "
            "per stage), on (also the CPU stages); default: the pipeline file's device_groups, else auto"
        ),
    )
    sp.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    sp.set_defaults(func=run_bench_speech)

    # Listed here; main() hands its arguments to benchmarks/chaos.py's own parser.
    bsub.add_parser(
        "chaos",
        add_help=False,
        help="serve over a replicated pipeline while replicas are SIGKILLed: what the clients saw "
        "(omnirelay bench chaos --help)",
    )


def _run_gpu_transfer(args: argparse.Namespace, payloads: list[str] | None) -> int:
    import torch

    from benchmarks.transfer_gpu import GPU_PAYLOADS, render_gpu_table, run_gpu_transfer_bench
    from omnirelay.connectors.device import cuda_index

    devices = [d.strip() for d in args.gpu.split(",") if d.strip()]
    if not 1 <= len(devices) <= 2 or any(cuda_index(d) is None for d in devices):
        raise SystemExit("omnirelay bench transfer: --gpu takes one or two CUDA devices, e.g. cuda:0,cuda:1")
    if not torch.cuda.is_available() or max(cuda_index(d) or 0 for d in devices) >= torch.cuda.device_count():
        raise SystemExit(f"omnirelay bench transfer: --gpu {args.gpu}: no such CUDA device here")
    unknown = [p for p in payloads or [] if p not in GPU_PAYLOADS]
    if unknown:
        raise SystemExit(
            f"omnirelay bench transfer: unknown payloads {unknown}; known: {', '.join(GPU_PAYLOADS)}"
        )
    results = run_gpu_transfer_bench(devices, payloads, scale=args.scale)
    print(render_gpu_table(results))
    _write_json(args.json, results)
    return 0


def run_bench_transfer(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.transfer import render_table, run_transfer_bench
    from omnirelay.interpreter import interpreter_info

    payloads = [x.strip() for x in args.payloads.split(",")] if args.payloads else None
    if args.scale <= 0:
        raise SystemExit("omnirelay bench transfer: --scale must be > 0")
    if args.gpu:
        return _run_gpu_transfer(args, payloads)
    if args.backend == "nixl":
        from benchmarks.transfer_hosts import render_hosts_table, run_hosts_bench
        from omnirelay.connectors.nixl import unavailable_reason

        missing = unavailable_reason()  # before any process starts: one line, no wait
        if missing is not None:
            raise SystemExit(f"omnirelay bench transfer: --backend nixl: {missing}")

        hosts = run_hosts_bench(payloads, scale=args.scale, pin=not args.no_pin)
        print(render_hosts_table(hosts))
        _write_json(args.json, hosts)
        return 1 if hosts["leaks"] else 0
    results = run_transfer_bench(
        payloads, scale=args.scale, baseline=not args.no_baseline, pin=not args.no_pin
    )
    print(render_table(results))
    ok = True
    print()
    for name, target in TRANSFER_TARGETS_US.items():
        e = results["payloads"].get(name)
        if e is None:
            continue
        p50 = e["ours"]["p50_us"]
        verdict = "meets" if p50 <= target else "MISSES"
        ok &= p50 <= target
        print(f"target {name}: p50 {p50:,.0f} µs {verdict} the {target:,.0f} µs target")
    results["env"] = {
        "python": platform.python_version(),
        "interpreter": interpreter_info().to_dict(),
        "torch": torch.__version__,
        "cpus": _cpus(),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok and not results["leaks"] else 1


def run_bench_stress(args: argparse.Namespace) -> int:
    from benchmarks.stress import render_stress, run_stress

    try:
        report = run_stress(
            requests=args.requests,
            chunks=args.chunks,
            cancel_fraction=args.cancel_fraction,
            seed=args.seed,
            timeout_s=args.timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"omnirelay bench stress: {exc}") from exc
    print(render_stress(report))
    _write_json(args.json, report)
    return 0 if report["ok"] else 1


def run_bench_adapter(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.adapter_latency import (
        render_adapter_latency,
        render_adapter_runs,
        run_adapter_latency,
        summarize_adapter_runs,
        targets_met,
    )

    if args.runs < 1:
        raise SystemExit(f"omnirelay bench adapter: --runs must be >= 1, got {args.runs}")
    results: list[dict[str, Any]] = []
    for i in range(args.runs):
        if args.runs > 1:
            print(f"[bench adapter] run {i + 1} of {args.runs}", file=sys.stderr, flush=True)
        try:
            result = run_adapter_latency(
                args.chunks,
                args.chunks,
                warmup=args.warmup,
                seed=args.seed + i,
                timeout_s=args.timeout,
                pin=not args.no_pin,
            )
        except ValueError as exc:
            raise SystemExit(f"omnirelay bench adapter: {exc}") from exc
        result["env"].update(torch=torch.__version__)
        results.append(result)
    print(render_adapter_latency(results[-1]))
    if args.runs == 1:
        _write_json(args.json, results[0])
        return 0 if results[0]["ok"] and targets_met(results[0]) else 1
    summary = summarize_adapter_runs(results)
    print()
    print(render_adapter_runs(summary))
    _write_json(args.json, {**summary, "results": results})
    return 0 if summary["ok"] and summary["targets_met"] else 1


def run_bench_pipeline(args: argparse.Namespace) -> int:
    from benchmarks.mps import MpsError
    from benchmarks.pipeline import render_pipeline_bench, run_pipeline_bench, target_met

    levels = _numbers(args.concurrency, int, "pipeline: --concurrency", "integers like 1,4,16")
    try:
        report = run_pipeline_bench(
            concurrency=levels,
            requests=args.requests,
            warmup=args.warmup,
            prompt=args.prompt,
            pipeline=args.pipeline,
            device=args.device,
            load_format=args.load_format,
            runner=args.runner,
            timeout_s=args.timeout,
            mps=args.mps,
            schedule=args.schedule,
            max_audio_streams=args.max_audio_streams,
            device_groups=args.device_groups,
        )
    except (ValueError, MpsError) as exc:
        raise SystemExit(f"omnirelay bench pipeline: {exc}") from exc
    print(render_pipeline_bench(report))
    _write_json(args.json, report)
    return 0 if report["ok"] and target_met(report) is not False else 1


def run_bench_tts_talker(args: argparse.Namespace) -> int:
    from benchmarks.tts_talker import render_tts_talker_bench, run_tts_talker_bench

    batches = _numbers(args.batches, int, "tts-talker: --batches", "integers like 1,8,64")
    try:
        report = run_tts_talker_bench(
            model=args.model,
            device=args.device,
            load_format=args.load_format,
            batches=batches,
            reps=args.reps,
            prefill_tokens=args.prefill_tokens,
            profile=args.profile,
        )
    except ValueError as exc:
        raise SystemExit(f"omnirelay bench tts-talker: {exc}") from exc
    print(render_tts_talker_bench(report))
    _write_json(args.json, report)
    return 0 if not report["leak_state"] else 1


def run_bench_runner(args: argparse.Namespace) -> int:
    from benchmarks.runner import render_runner_bench, run_runner_bench

    try:
        stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
        report = run_runner_bench(
            device=args.device, reps=args.reps, stages=stages, code2wav_compiled=args.code2wav_compiled
        )
    except ValueError as exc:
        raise SystemExit(f"omnirelay bench runner: {exc}") from exc
    print(render_runner_bench(report))
    _write_json(args.json, report)
    ok = report.get("thinker", {}).get("greedy_ids_equal", True) and report.get("talker", {}).get(
        "greedy_codes_equal", True
    )
    return 0 if ok else 1


def run_bench_serve(args: argparse.Namespace) -> int:
    from benchmarks.serve import DEFAULT_TEXT, render_serve_bench, run_serve_bench

    levels = _numbers(args.concurrency, int, "serve: --concurrency", "integers like 1,8,32")
    try:
        report = run_serve_bench(
            pipeline=args.pipeline,
            url=args.url,
            concurrency=levels,
            requests=args.requests,
            warmup=args.warmup,
            text=args.text if args.text is not None else DEFAULT_TEXT,
            voice=args.voice,
            timeout_s=args.timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"omnirelay bench serve: {exc}") from exc
    print(render_serve_bench(report))
    _write_json(args.json, report)
    return 0 if report["ok"] else 1


def run_bench_speech(args: argparse.Namespace) -> int:
    from benchmarks.mps import MpsError
    from benchmarks.speech import render_speech_bench, run_speech_bench

    rates = _numbers(args.rates, float, "speech: --rates", "numbers like 1,20")
    try:
        report = run_speech_bench(
            pipeline=args.pipeline,
            device=args.device,
            load_format=args.load_format,
            rates=rates,
            duration_s=args.duration,
            requests=args.requests,
            warmup=args.warmup,
            seed=args.seed,
            max_frames=args.max_frames,
            timeout_s=args.timeout,
            mps=args.mps,
            device_groups=args.device_groups,
        )
    except (ValueError, MpsError) as exc:
        raise SystemExit(f"omnirelay bench speech: {exc}") from exc
    print(render_speech_bench(report))
    _write_json(args.json, report)
    return 0 if report["ok"] and all(report["targets_met"].values()) else 1


def _numbers(text: str, kind: Callable[[str], N], option: str, example: str) -> list[N]:
    """A comma-separated option's numbers, or a clear exit naming the bench and option
    (``option``: ``"speech: --rates"``) and what it takes (``example``)."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise SystemExit(f"omnirelay bench {option} must be {example}: {exc}") from exc


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
