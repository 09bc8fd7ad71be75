"""``omnirelay bench stress``: cross-process chunk transfers through the adapter, then a leak audit.

:func:`run_stress` builds a seeded plan (:mod:`benchmarks.stress_plan`), spawns a
producer process (stage 1, :mod:`~benchmarks.stress_producer`) and a consumer process
(stage 2, :mod:`~benchmarks.stress_consumer`) over one fresh shm namespace, collects
their reports, checks them and returns one JSON-able report; :func:`render_stress`
prints it.

What a run does (defaults: 600 requests x 10 chunks): at most ``window`` requests open at
once on the producer, which sends one chunk per request at a time; at most
``consumer_window`` of them read at once on the consumer, so the others' chunks pile up
unread (a downstream stage with fewer slots); 5 % of chunks are 4 MB, the rest codec-sized; ``cancel_fraction`` of the requests are
aborted — before, during or after their puts, through ``cleanup`` or ``cleanup_sender`` on
the sender and ``cleanup_receiver`` on the receiver — and about half of those ids are
started again as a new generation once the old one drained; ``early_stop_fraction`` of
the requests have a consumer that stops reading midway, whose unread chunks the
orchestrator releases by id (``cleanup_prefix``).

``ok`` holds only if: every non-cancelled generation delivered all its chunks in order,
exactly once (early stops: exactly the chunks read); no chunk crossed generations; every
published object was either consumed or removed (puts = gets + removals); no failures and
no adapter errors; and the leak audit is clean in both processes — no pending keys, no
adapter state, no published object left — and nothing of the namespace remains in
/dev/shm once both processes exited. The whole run is bounded by ``timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import msgspec

from benchmarks.stress_consumer import consumer_main
from benchmarks.stress_plan import ConsumerReport, ProducerReport, RequestPlan, Settings, make_plan
from benchmarks.stress_producer import producer_main
from omnirelay.connectors.shm import sweep

__all__ = ["render_stress", "run_stress"]

#: Seconds the processes get to report after the deadline before they are killed.
_GRACE_S = 15.0


def run_stress(
    requests: int = 600,
    chunks: int = 10,
    cancel_fraction: float = 0.15,
    seed: int = 0,
    *,
    big_fraction: float = 0.05,
    early_stop_fraction: float = 0.1,
    reuse_fraction: float = 0.5,
    window: int = 32,
    consumer_window: int = 8,
    timeout_s: float = 600.0,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the stress benchmark; returns the report (``report["ok"]``: every check passed)."""
    _validate(requests, chunks, cancel_fraction, big_fraction, early_stop_fraction, reuse_fraction, window)
    if consumer_window < 1:
        raise ValueError(f"consumer_window must be >= 1, got {consumer_window}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    plans = make_plan(
        num_requests=requests,
        num_chunks=chunks,
        cancel_fraction=cancel_fraction,
        seed=seed,
        big_fraction=big_fraction,
        early_stop_fraction=early_stop_fraction,
        reuse_fraction=reuse_fraction,
    )
    namespace = f"stress{uuid.uuid4().hex[:10]}"
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    child_deadline = deadline - min(_GRACE_S, 0.2 * timeout_s)
    settings = Settings(
        namespace=namespace,
        num_chunks=chunks,
        window=window,
        consumer_window=consumer_window,
        seed=seed,
        deadline=child_deadline,
    )
    log(
        f"[bench stress] {requests} requests x {chunks} chunks, namespace {namespace}, "
        f"timeout {timeout_s:g} s"
    )
    ctx = mp.get_context("spawn")
    prod_ctrl, cons_ctrl = ctx.Pipe()
    prod_out_r, prod_out_w = ctx.Pipe(duplex=False)
    cons_out_r, cons_out_w = ctx.Pipe(duplex=False)
    consumer_ready, stop = ctx.Event(), ctx.Event()
    args_bytes = (msgspec.msgpack.encode(settings), msgspec.msgpack.encode(plans))
    consumer = ctx.Process(
        target=consumer_main,
        args=(*args_bytes, cons_ctrl, cons_out_w, consumer_ready, stop),
        name="omnirelay-stress-consumer",
    )
    producer = ctx.Process(
        target=producer_main,
        args=(*args_bytes, prod_ctrl, prod_out_w, consumer_ready, stop),
        name="omnirelay-stress-producer",
    )
    procs = (producer, consumer)
    errors: list[str] = []
    reports: dict[str, bytes] = {}
    try:
        consumer.start()
        producer.start()
        pending = {prod_out_r: "producer", cons_out_r: "consumer"}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(pending), timeout=left):
                name = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    reports[name] = conn.recv_bytes()  # type: ignore[union-attr]
                except EOFError:
                    errors.append(f"the {name} process exited without a report")
        if pending:
            stop.set()
            errors.append(
                f"stress run timed out after {timeout_s:g} s with no report from "
                f"{' and '.join(sorted(pending.values()))}"
            )
    finally:
        stop.set()
        for proc in procs:
            if proc.pid is None:
                continue  # never started
            proc.join(_GRACE_S)
            if proc.is_alive():
                errors.append(f"the {proc.name} process had to be killed")
                proc.kill()
                proc.join(5)
    # Once both owners are gone nothing of the namespace may remain; reclaim anything that
    # did (dead owners only) so a failed run does not leave garbage behind.
    leftover = sweep(namespace, reclaim=True).objects
    prod = msgspec.msgpack.decode(reports["producer"], type=ProducerReport) if "producer" in reports else None
    cons = msgspec.msgpack.decode(reports["consumer"], type=ConsumerReport) if "consumer" in reports else None
    for name, proc in (("producer", producer), ("consumer", consumer)):
        if proc.exitcode not in (0, None) and name in reports:
            errors.append(f"the {name} process exited with status {proc.exitcode}")
    return _build_report(
        plans=plans,
        chunks=chunks,
        seed=seed,
        fractions=(cancel_fraction, big_fraction, early_stop_fraction, reuse_fraction),
        window=(window, consumer_window),
        timeout_s=timeout_s,
        wall_s=time.monotonic() - t0,
        prod=prod,
        cons=cons,
        leftover=[f"{o.kind}:{o.key or o.name}" for o in leftover],
        errors=errors,
    )


def _validate(
    requests: int,
    chunks: int,
    cancel_fraction: float,
    big_fraction: float,
    early_stop_fraction: float,
    reuse_fraction: float,
    window: int,
) -> None:
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if chunks < 2:
        raise ValueError(
            f"chunks must be >= 2 (a cancel 'during' and an early stop need a middle), got {chunks}"
        )
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for name, value in (
        ("cancel_fraction", cancel_fraction),
        ("big_fraction", big_fraction),
        ("early_stop_fraction", early_stop_fraction),
        ("reuse_fraction", reuse_fraction),
    ):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be within [0, 1], got {value}")
    if cancel_fraction + early_stop_fraction > 1.0:
        raise ValueError("cancel_fraction + early_stop_fraction must be <= 1 (a request is one or the other)")


def _build_report(
    *,
    plans: list[RequestPlan],
    chunks: int,
    seed: int,
    fractions: tuple[float, float, float, float],
    window: tuple[int, int],
    timeout_s: float,
    wall_s: float,
    prod: ProducerReport | None,
    cons: ConsumerReport | None,
    leftover: list[str],
    errors: list[str],
) -> dict[str, Any]:
    cancel_fraction, big_fraction, early_stop_fraction, reuse_fraction = fractions
    num_cancelled = sum(1 for p in plans if p.cancel_phase is not None)
    num_reused = sum(1 for p in plans if p.reuse)
    num_stopped = sum(1 for p in plans if p.stop_after is not None)
    num_normal = len(plans) - num_cancelled
    report: dict[str, Any] = {
        "ok": False,
        "error": None,
        "config": {
            "requests": len(plans),
            "chunks": chunks,
            "seed": seed,
            "cancel_fraction": cancel_fraction,
            "big_fraction": big_fraction,
            "early_stop_fraction": early_stop_fraction,
            "reuse_fraction": reuse_fraction,
            "window": window[0],
            "consumer_window": window[1],
            "timeout_s": timeout_s,
        },
        "plan": {
            "cancelled": num_cancelled,
            "reused": num_reused,
            "early_stop": num_stopped,
            "complete": num_normal - num_stopped,
        },
        "wall_s": wall_s,
    }
    for name, r in (("producer", prod), ("consumer", cons)):
        if r is not None and r.error:
            errors.append(f"{name}: {r.error}")
    if prod is None or cons is None:
        report["error"] = "; ".join(errors) or "a process did not report"
        report["producer"] = msgspec.to_builtins(prod) if prod else None
        report["consumer"] = msgspec.to_builtins(cons) if cons else None
        report["leftover_objects"] = leftover
        return report
    removed_cancel = prod.num_removed_exact + prod.num_removed_prefix_cancel
    counts = {
        "sent": prod.num_puts,
        "sent_big": prod.num_big_puts,
        "bytes_sent": prod.bytes_put,
        "admitted": prod.num_admitted,
        "consumed": cons.num_gets,
        "delivered": cons.num_delivered,
        "delivered_big": cons.num_big_delivered,
        "consumed_not_delivered": cons.num_gets - cons.num_delivered,
        "bytes_consumed": cons.bytes_got,
        "cancelled": sum(prod.cancels_planned.values()),
        "cancelled_by_phase_planned": prod.cancels_planned,
        "cancelled_by_phase_observed": prod.cancels_observed,
        "cancelled_via": prod.cancels_via,
        "cancelled_unread": removed_cancel,
        "reclaimed_exact_key_cleanup": prod.num_removed_exact,
        "reclaimed_prefix_after_cancel": prod.num_removed_prefix_cancel,
        "early_stop_unread": prod.num_removed_prefix_stop,
        "reclaimed_prefix_after_early_stop": prod.num_removed_prefix_stop,
        "exact_key_cleanup_calls": prod.num_cleanup_calls,
        "reused_ids": prod.num_reused,
        "completed": cons.num_completed,
        "completed_reused": cons.num_completed_reused,
        "completed_then_cancelled": cons.num_completed_then_cancelled,
        "early_stopped": cons.num_stopped,
        "released_after_cancel": cons.num_released,
        "left_unaccounted": prod.num_puts
        - cons.num_gets
        - prod.num_removed_exact
        - prod.num_removed_prefix_cancel
        - prod.num_removed_prefix_stop,
    }
    duration = max(1e-9, prod.t_end - prod.t_start)
    report["duration_s"] = duration
    report["throughput"] = {
        "chunks_per_s": prod.num_puts / duration,
        "mb_per_s": prod.bytes_put / duration / 1e6,
    }
    report["counts"] = counts
    report["audit"] = {
        "producer": msgspec.to_builtins(prod.audit),
        "consumer": msgspec.to_builtins(cons.audit),
        "objects_after_exit": leftover,
    }
    report["open_requests"] = {"producer": prod.open_requests, "consumer": cons.open_requests}
    report["failures"] = prod.failures + cons.failures
    report["problems"] = [f"producer: {p}" for p in prod.problems] + [f"consumer: {p}" for p in cons.problems]
    report["adapter_stats"] = {"sender": prod.sender_stats, "receiver": cons.receiver_stats}
    pa, ca = prod.audit, cons.audit
    checks = {
        "no process error": not errors,
        "every request resolved": prod.num_resolved == len(plans) and not prod.open_requests,
        "every complete generation delivered all chunks": cons.num_completed
        - cons.num_completed_then_cancelled
        == (num_normal - num_stopped) + prod.num_reused
        and cons.num_completed_reused == prod.num_reused == num_reused,
        "early stops read exactly their chunks": cons.num_stopped == num_stopped,
        "every cancel released on both sides": cons.num_released == num_cancelled
        and counts["cancelled"] == num_cancelled,
        "in order, exactly once, right generation": not cons.problems,
        "producer books consistent": not prod.problems,
        "no transfer failures": not report["failures"]
        and prod.num_put_failures == 0
        and cons.num_get_failures == 0,
        "sent = consumed + reclaimed": counts["left_unaccounted"] == 0,
        "zero objects in the namespace": not pa.live_objects and not leftover,
        "zero pending keys": pa.num_pending_keys == 0 and ca.num_pending_keys == 0,
        "zero sender-side pending bytes": pa.live_bytes == 0,
        "zero adapter state": pa.leak_state == {} and ca.leak_state == {},
        "queues drained": pa.is_flushed and ca.is_flushed,
        "no adapter errors": pa.num_adapter_errors == 0 and ca.num_adapter_errors == 0,
    }
    report["checks"] = checks
    report["ok"] = all(checks.values())
    if errors:
        report["error"] = "; ".join(errors)
    report["meets_issue_scale"] = {
        "transfers >= 5,000": prod.num_puts >= 5000,
        "requests >= 500": len(plans) >= 500,
        "cancelled >= 10%": num_cancelled >= 0.1 * len(plans),
    }
    return report


# ---------------------------------------------------------------------- rendering


def render_stress(report: dict[str, Any]) -> str:
    cfg, plan = report["config"], report["plan"]
    lines = [
        f"omnirelay bench stress: {cfg['requests']} requests x {cfg['chunks']} chunks, seed {cfg['seed']}, "
        f"windows {cfg['window']}/{cfg['consumer_window']}; producer (stage 1) -> consumer (stage 2) processes over shm",
        f"plan: {plan['cancelled']} cancelled ({plan['reused']} of them reused), {plan['early_stop']} early "
        f"stops, {plan['complete']} complete; {cfg['big_fraction']:.0%} of chunks 4 MB",
    ]
    if "counts" not in report:
        lines.append(f"RESULT: FAILED - {report.get('error')}")
        if report.get("leftover_objects"):
            lines.append(f"objects left (reclaimed after exit): {report['leftover_objects'][:10]}")
        return "\n".join(lines)
    c = report["counts"]
    big = c["sent_big"]
    lines += [
        "",
        "transfers",
        f"  sent (successful puts)         {c['sent']:>8,}   ({c['sent'] - big:,} codec 16x50 int64, {big:,} x 4 MB;"
        f" {c['bytes_sent'] / 1e9:.2f} GB)",
        f"  consumed (gets)                {c['consumed']:>8,}   ({c['delivered']:,} delivered in order, "
        f"{c['consumed_not_delivered']:,} read while their request was being cancelled)",
        f"  cancelled unread               {c['cancelled_unread']:>8,}   reclaimed by exact-key cleanup of the "
        f"cancelled generation {c['reclaimed_exact_key_cleanup']:,}, by prefix release after a cancel "
        f"{c['reclaimed_prefix_after_cancel']:,}",
        f"  early-stop unread              {c['early_stop_unread']:>8,}   reclaimed by prefix release",
        f"  unaccounted (sent - consumed - reclaimed) {c['left_unaccounted']:>,}",
        "",
        "requests",
        f"  completed                      {c['completed']:>8,}   ({c['completed_reused']:,} of them reused ids"
        f" in a new generation, {c['completed_then_cancelled']:,} read in full before their cancel arrived)",
        f"  early stopped                  {c['early_stopped']:>8,}",
        f"  cancelled                      {c['cancelled']:>8,}   planned {_fmt_counts(c['cancelled_by_phase_planned'])}; "
        f"observed at the cancel {_fmt_counts(c['cancelled_by_phase_observed'])}; via {_fmt_counts(c['cancelled_via'])}",
        f"  reused ids                     {c['reused_ids']:>8,}",
        "",
        f"duration {report['duration_s']:.2f} s ({report['throughput']['chunks_per_s']:,.0f} chunks/s, "
        f"{report['throughput']['mb_per_s']:,.0f} MB/s); wall time with process start {report['wall_s']:.1f} s",
        "",
        "leak audit",
    ]
    a = report["audit"]
    for side in ("producer", "consumer"):
        x = a[side]
        lines.append(
            f"  {side:<9} pending keys {x['num_pending_keys']}, adapter state {_fmt_state(x['leak_state'])}, "
            f"live bytes {x['live_bytes']}, adapter errors {x['num_adapter_errors']}"
            + (f", published objects {len(x['live_objects'])}" if side == "producer" else "")
        )
    lines.append(
        f"  /dev/shm objects of the namespace after both processes exited: {len(a['objects_after_exit'])}"
    )
    lines += ["", "checks"]
    for name, passed in report["checks"].items():
        lines.append(f"  [{'ok' if passed else 'FAIL'}] {name}")
    for what in ("problems", "failures"):
        if report.get(what):
            lines.append(f"{what} ({len(report[what])}): " + "; ".join(report[what][:10]))
    scale = report["meets_issue_scale"]
    lines.append("issue scale: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in scale.items()))
    for side in ("producer", "consumer"):
        if report["open_requests"][side]:
            lines.append(f"open at the end ({side}): " + "; ".join(report["open_requests"][side][:5]))
    lines.append(
        f"RESULT: {'OK' if report['ok'] else 'FAILED'}" + (f" - {report['error']}" if report["error"] else "")
    )
    return "\n".join(lines)


def _fmt_state(state: dict[str, Any]) -> str:
    """``{}``, or the size of every non-empty map (the full maps are in the JSON report)."""
    if not state:
        return "{}"
    return "{" + ", ".join(f"{k}: {len(v) if hasattr(v, '__len__') else v}" for k, v in state.items()) + "}"


def _fmt_counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"
