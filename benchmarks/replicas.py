"""Stage replicas: throughput scaling and failover under load (``python -m benchmarks.replicas``).

The pipeline is the toy ``counter -> relay -> synth`` over shared memory (or across two
simulated Ray hosts), with the **relay as the bottleneck**: its executor's every step takes
``--step-ms`` whatever its batch (it sleeps — a stand-in for an accelerator step, which
takes time but no CPU of this machine) and it runs at most ``--batch`` requests at once.
One replica of it then serves ``batch / ((tokens + 1) * step)`` requests a second, and
``N`` replicas should serve ``N`` times as many while the other stages keep up.

* ``scaling`` — requests/s with 1, 2 and 4 relay replicas (``--replicas``), one closed-loop
  run each at ``--concurrency``, in one invocation; every answer checked exactly.
* ``hosts`` — the same on a local two-node Ray cluster (``hostA``, ``hostB``; UCX over
  TCP): one relay replica on hostA, then one on each host (the edges to and from the hostB
  replica take the nixl connector).
* ``failover`` — ``--requests`` requests at ``--concurrency`` over ``--replicas`` relay
  replicas; once ``--kill-after`` have completed, one relay replica is SIGKILLed. Every
  request asks for audio only, so the client hears nothing of it before the relay has
  run it: a request that fails without having delivered anything is a failover error
  (target 0), one that fails after its audio started is a stream that failed fast
  (its time from the kill is reported), and every completed answer must be exact and
  whole (no chunk missing or delivered twice). Ends with the leak audit and nothing of
  the namespace left under /dev/shm.

Each run prints a table and, with ``--json``, writes its figures. Exit status 1 when a
target is missed (scaling ≥ 1.8× at 2 and ≥ 3× at 4; failover errors 0; wrong answers
0; leaks 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from omnirelay import Pipeline, RestartPolicy, RuntimeHooks, SamplingParams
from omnirelay.connectors.shm import sweep
from omnirelay.errors import OmniRelayError
from omnirelay.models.testing.toy import (
    expected_counting_tokens,
    expected_relay_tokens,
    expected_waveform,
)
from omnirelay.pipeline import PipelineConfig, parse_pipeline
from omnirelay.worker import leak_paths

__all__ = ["failover", "main", "scaling", "toy_config"]

TOY_FACTORY = "omnirelay.worker.factory:build_stage_engine"
FAST_RESTART = RestartPolicy(max_restarts=10, window_s=300, backoff_s=0.2, max_backoff_s=1.0)


@dataclass(frozen=True)
class Load:
    """The bottleneck and the load: relay step duration and batch, tokens per request,
    requests and concurrency."""

    step_s: float = 0.05
    batch: int = 4
    tokens: int = 8
    requests: int = 96
    concurrency: int = 32


def toy_config(replicas: int, load: Load, *, hosts: tuple[str, ...] = ()) -> PipelineConfig:
    """The toy pipeline with ``replicas`` relay workers; with ``hosts``, placed on Ray:
    counter and synth on the first host, relay replica ``k`` on ``hosts[k % len(hosts)]``."""
    relay: dict[str, Any] = {
        "id": 1,
        "name": "relay",
        "execution_type": "ar",
        "executor": "toy.relay_lm",
        "executor_args": {"step_s": load.step_s},
        "input_sources": [0],
        "chunk_processor": "toy.forward_chunk",
        "max_num_seqs": load.batch,
        "replicas": replicas,
        "sampling": {"max_tokens": 100000},
    }
    stages: list[dict[str, Any]] = [
        {
            "id": 0,
            "name": "counter",
            "execution_type": "ar",
            "executor": "toy.counting_lm",
            "final_output": True,
            "final_output_type": "text",
            "chunk_processor": "toy.forward_chunk",
            "max_num_seqs": 512,
            "sampling": {"max_tokens": load.tokens},
        },
        relay,
        {
            "id": 2,
            "name": "synth",
            "execution_type": "generation",
            "executor": "toy.sample_generator",
            "executor_args": {"samples_per_code": 4},
            "input_sources": [1],
            "final_output": True,
            "final_output_type": "audio",
            "max_num_seqs": 512,
            "async_scheduling": False,
        },
    ]
    data: dict[str, Any] = {
        "name": f"toy-relay-x{replicas}",
        "async_chunk": True,
        "input_wait_timeout_s": 120,
        "stages": stages,
    }
    if hosts:
        data["placement"] = {"backend": "ray", "address": "auto"}
        stages[0]["resources"] = {hosts[0]: 1}
        stages[2]["resources"] = {hosts[0]: 1}
        relay["resources"] = [{hosts[k % len(hosts)]: 1} for k in range(replicas)]
    return parse_pipeline(data, source="<benchmarks.replicas>")


def expected_audio(prompt: int, tokens: int) -> torch.Tensor:
    return expected_waveform(expected_relay_tokens(expected_counting_tokens([prompt], tokens)))


# -------------------------------------------------------------------------- a run


@dataclass
class Outcome:
    request_id: str
    ok: bool = False
    exact: bool = False
    delivered: bool = False  # the client had an output before the end
    error: str | None = None
    error_code: str | None = None
    ended_at: float = 0.0


@dataclass
class RunResult:
    replicas: int
    requests: int
    seconds: float
    requests_per_s: float
    completed: int
    wrong: int
    failed_silent: int  # failed without having delivered anything (a failover error)
    failed_streaming: int  # failed after the client heard audio (fail fast)
    fail_fast_s: list[float] = field(default_factory=list)
    reruns: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)


def _one(pipe: Pipeline, i: int, load: Load) -> Outcome:
    rid = f"req-{i}"
    out = Outcome(rid)
    prompt = 1 + (i * 37) % 500
    try:
        handle = pipe.submit(
            [prompt],
            modalities=["audio"],
            sampling={0: SamplingParams(max_tokens=load.tokens)},
            request_id=rid,
        )
        pieces = []
        for o in handle:
            if o.error is not None:
                out.error, out.error_code = o.error, o.error_code
                break
            if o.audio is not None and o.audio.numel():
                out.delivered = True
                pieces.append(o.audio)
        else:
            audio = torch.cat(pieces) if pieces else torch.zeros(0)
            out.ok = True
            out.exact = torch.equal(audio, expected_audio(prompt, load.tokens))
    except OmniRelayError as exc:
        out.error = str(exc)
        out.error_code = getattr(exc, "code", None)
    out.ended_at = time.monotonic()
    return out


def closed_loop(
    pipe: Pipeline, load: Load, *, on_done: Callable[[int], None] | None = None
) -> tuple[list[Outcome], float]:
    """``load.requests`` requests, ``load.concurrency`` at a time; the outcomes and the wall time."""
    nxt = iter(range(load.requests))
    lock = threading.Lock()
    outcomes: list[Outcome] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            o = _one(pipe, i, load)
            with lock:
                outcomes.append(o)
                done = len(outcomes)
            if on_done is not None:
                on_done(done)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(load.concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.monotonic() - t0


def _audit(pipe: Pipeline) -> list[str]:
    problems = []
    for worker, state in pipe.leak_state().items():
        paths = leak_paths(state)
        if paths:
            problems.append(f"worker {worker}: {paths}")
    objects = [o for o in sweep(pipe.namespace).objects if o.kind != "slot"]
    if objects:
        problems.append(f"{len(objects)} transfer objects left")
    return problems


def _per_replica(pipe: Pipeline) -> dict[str, int]:
    return {
        f"relay[{s.replica}]": int((s.engine or {}).get("num_added", 0))
        for s in pipe.health().stages
        if s.stage_id == 1
    }


def _summarize(replicas: int, load: Load, outcomes: list[Outcome], seconds: float) -> RunResult:
    completed = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    return RunResult(
        replicas=replicas,
        requests=len(outcomes),
        seconds=round(seconds, 3),
        requests_per_s=round(len(completed) / seconds, 3) if seconds else 0.0,
        completed=len(completed),
        wrong=sum(1 for o in completed if not o.exact),
        failed_silent=sum(1 for o in failed if not o.delivered),
        failed_streaming=sum(1 for o in failed if o.delivered),
    )


@contextmanager
def _started(cfg: PipelineConfig, restart: RestartPolicy | None = None) -> Iterator[Pipeline]:
    pipe = Pipeline.start(cfg, restart=restart, runtime=RuntimeHooks(engine_factory=TOY_FACTORY))
    try:
        yield pipe
    finally:
        report = pipe.shutdown()
        left = sweep(pipe.namespace).objects
        if left or report.num_objects_left:
            print(f"  ! {len(left)} objects of {pipe.namespace} left after shutdown", file=sys.stderr)


def run_once(replicas: int, load: Load, *, hosts: tuple[str, ...] = ()) -> RunResult:
    with _started(toy_config(replicas, load, hosts=hosts)) as pipe:
        warm = Load(load.step_s, load.batch, load.tokens, requests=2 * replicas, concurrency=2 * replicas)
        closed_loop(pipe, warm)
        outcomes, seconds = closed_loop(pipe, load)
        result = _summarize(replicas, load, outcomes, seconds)
        result.per_replica = _per_replica(pipe)
        result.leaks = _audit(pipe)
    return result


def scaling(load: Load, replica_counts: Sequence[int], *, hosts: tuple[str, ...] = ()) -> list[RunResult]:
    return [run_once(n, load, hosts=hosts) for n in replica_counts]


def failover(load: Load, replicas: int, kill_after: int) -> RunResult:
    """One run with a relay replica SIGKILLed once ``kill_after`` requests completed."""
    killed: dict[str, Any] = {}
    with _started(toy_config(replicas, load), FAST_RESTART) as pipe:
        closed_loop(pipe, Load(load.step_s, load.batch, load.tokens, requests=2 * replicas, concurrency=4))

        def on_done(done: int) -> None:
            if done >= kill_after and not killed:
                killed["at"] = time.monotonic()
                pid = pipe.replica_pids()[(1, replicas - 1)]
                assert pid is not None
                killed["pid"] = pid
                os.kill(pid, signal.SIGKILL)

        outcomes, seconds = closed_loop(pipe, load, on_done=on_done)
        result = _summarize(replicas, load, outcomes, seconds)
        kill_at = killed.get("at", 0.0)
        result.fail_fast_s = sorted(
            round(o.ended_at - kill_at, 3) for o in outcomes if not o.ok and o.delivered and kill_at
        )
        health = pipe.health()
        result.reruns = health.num_reruns
        pipe.wait_ready(120)
        result.per_replica = _per_replica(pipe)
        result.leaks = _audit(pipe)
    return result


# -------------------------------------------------------------------------- report


def _print_scaling(title: str, results: list[RunResult]) -> None:
    base = results[0].requests_per_s or 1.0
    print(f"\n{title}")
    print(
        f"  {'relay replicas':>14}  {'requests/s':>10}  {'vs 1':>6}  {'wrong':>5}  {'failed':>6}  per replica"
    )
    for r in results:
        print(
            f"  {r.replicas:>14}  {r.requests_per_s:>10.2f}  {r.requests_per_s / base:>5.2f}x  {r.wrong:>5}  "
            f"{r.failed_silent + r.failed_streaming:>6}  {r.per_replica}"
        )


def _scaling_ok(results: list[RunResult]) -> bool:
    base = results[0].requests_per_s
    targets = {2: 1.8, 4: 3.0}
    ok = all(r.wrong == 0 and not r.leaks and r.completed == r.requests for r in results)
    for r in results:
        if r.replicas in targets and base:
            ok = ok and r.requests_per_s / base >= targets[r.replicas]
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "runs", nargs="*", default=["scaling", "failover"], choices=["scaling", "hosts", "failover"]
    )
    p.add_argument("--step-ms", type=float, default=50.0, help="the relay's step, whatever its batch")
    p.add_argument("--batch", type=int, default=4, help="requests one relay replica runs at once")
    p.add_argument("--tokens", type=int, default=8, help="tokens per request (relay steps: tokens + 1)")
    p.add_argument("--requests", type=int, default=96, help="requests per scaling run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--replicas", default="1,2,4", help="relay replicas per scaling run")
    p.add_argument("--failover-requests", type=int, default=200)
    p.add_argument("--failover-replicas", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=60, help="completed requests before the kill")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    load = Load(args.step_ms / 1000, args.batch, args.tokens, args.requests, args.concurrency)
    report: dict[str, Any] = {"load": asdict(load)}
    ok = True
    counts = [int(x) for x in args.replicas.split(",")]
    if "scaling" in args.runs:
        results = scaling(load, counts)
        _print_scaling("one host, shm edges", results)
        report["scaling"] = [asdict(r) for r in results]
        ok = ok and _scaling_ok(results)
    if "hosts" in args.runs:
        from omnirelay.orchestrator.local_cluster import local_cluster

        with local_cluster(("hostA", "hostB")):
            results = scaling(load, [1, 2], hosts=("hostA", "hostB"))
        _print_scaling("two simulated Ray hosts (relay replica 1 on hostB: nixl edges)", results)
        report["hosts"] = [asdict(r) for r in results]
        ok = ok and _scaling_ok(results)
    if "failover" in args.runs:
        fl = Load(load.step_s, load.batch, load.tokens, args.failover_requests, load.concurrency)
        r = failover(fl, args.failover_replicas, args.kill_after)
        report["failover"] = asdict(r)
        fast = f"{max(r.fail_fast_s):.3f} s max" if r.fail_fast_s else "none playing"
        print(
            f"\nfailover: {r.requests} requests at concurrency {fl.concurrency} over {r.replicas} relay "
            f"replicas, one SIGKILLed after {args.kill_after} completed\n"
            f"  completed {r.completed} (wrong {r.wrong}); failed before any output {r.failed_silent} "
            f"(target 0); playing streams failed fast {r.failed_streaming} ({fast}); reruns {r.reruns}; "
            f"{r.requests_per_s:.2f} requests/s; per replica {r.per_replica}; leaks {r.leaks or 'none'}"
        )
        ok = ok and r.failed_silent == 0 and r.wrong == 0 and not r.leaks
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
