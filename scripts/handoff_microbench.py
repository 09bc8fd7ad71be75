#!/usr/bin/env python
"""Caller → worker hand-off on one CPU: ``LaneExecutor.submit`` vs a ``queue.SimpleQueue``.

Why it exists: a thread woken while its waker holds the GIL preempts the waker on a shared
CPU, finds the GIL taken and is switched out again; it runs only at the waker's next GIL
release. ``LaneExecutor`` wakes its workers with an ``eventfd_write`` made outside its lock,
a system call CPython makes with the GIL released, so the woken worker takes the GIL at
once (``omnirelay/transfer/lanes.py``). This prints both hand-offs side by side, measured
in one run on one CPU the process is pinned to:

* ``hand-off``: the caller's ``perf_counter_ns`` just before the submit → the worker's
  first line of the task;
* ``caller``: the submit call's wall time on the caller (it includes the task where the
  worker runs first: the time is spent on that CPU either way).

After each hand-off the caller blocks in ``select`` until the task signals a pipe, as the
adapter benchmark's sender does. Usage: ``python scripts/handoff_microbench.py [--trials N]
[--cpu K] [--rounds R]`` (rounds alternate the two, so drift in machine speed hits both).
"""

from __future__ import annotations

import argparse
import os
import queue
import select
import statistics
import threading
import time
from collections.abc import Callable

from omnirelay.transfer.lanes import LaneExecutor


def _busy(n: int) -> int:
    x = 0
    for _ in range(n):
        x += 1
    return x


def _series(kind: str, trials: int) -> tuple[list[float], list[float]]:
    r, w = os.pipe()
    handoff: list[float] = []
    caller: list[float] = []
    sent = [0]

    def task() -> None:
        handoff.append((time.perf_counter_ns() - sent[0]) / 1e3)
        _busy(300)  # about a send task's Python
        os.write(w, b"x")

    submit: Callable[[], None]
    stop: Callable[[], None]
    if kind == "SimpleQueue":
        q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()

        def loop() -> None:
            while (fn := q.get()) is not None:
                fn()

        t = threading.Thread(target=loop, daemon=True)
        t.start()

        def submit() -> None:
            q.put(task)

        def stop() -> None:
            q.put(None)
            t.join()
    else:
        lanes = LaneExecutor("handoff-bench", 1, on_error=lambda e: None)
        lanes.start()

        def submit() -> None:
            lanes.submit("lane", task)

        def stop() -> None:
            lanes.stop(5.0)

    time.sleep(0.05)  # the worker is parked
    try:
        for _ in range(trials):
            _busy(2000)  # the caller holds the GIL up to the hand-off
            t0 = sent[0] = time.perf_counter_ns()
            submit()
            caller.append((time.perf_counter_ns() - t0) / 1e3)
            select.select([r], [], [], 5.0)
            os.read(r, 1)
    finally:
        stop()
        os.close(r)
        os.close(w)
    warm = trials // 10
    return handoff[warm:], caller[warm:]


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3000, help="hand-offs per series (default 3000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both series (default 3)")
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the first allowed)")
    args = ap.parse_args()
    if args.trials < 20 or args.rounds < 1:
        ap.error("--trials must be at least 20 and --rounds at least 1")
    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for kind in ("SimpleQueue", "LaneExecutor"):
            h, c = _series(kind, args.trials)
            r = results.setdefault(kind, {"handoff": [], "caller": []})
            r["handoff"].append(statistics.median(h))
            r["caller"].append(statistics.median(c))
            r.setdefault("handoff_p99", []).append(_p(h, 0.99))
    print(f"one CPU ({cpu}), {args.trials} hand-offs x {args.rounds} rounds; median of the rounds' p50 (p99)")
    print("| hand-off | submit → task runs p50 | p99 | caller's submit wall time p50 |")
    print("|---|---:|---:|---:|")
    for kind, r in results.items():
        print(
            f"| {kind} | {statistics.median(r['handoff']):.1f} µs | {statistics.median(r['handoff_p99']):.1f} µs "
            f"| {statistics.median(r['caller']):.1f} µs |"
        )
    base, ours = (statistics.median(results[k]["handoff"]) for k in ("SimpleQueue", "LaneExecutor"))
    print(f"LaneExecutor hand-off / SimpleQueue: {ours / base:.2f}x")


if __name__ == "__main__":
    main()
