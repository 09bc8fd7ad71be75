"""Soak the supervised pipeline: chunk transfers with cancellations, reused ids and stage
processes SIGKILLed and restarted (``python -m benchmarks.soak``).

Requests run through ``toy-3stage`` (one spawned worker per stage, chunked shm edges, toy
executors whose outputs are known exactly) at ``--concurrency`` until ``--transfers``
chunk transfers were delivered, counting only completed requests (a request of n tokens
moves n chunks Thinker → relay and n relay → synth: an undercount, never an overcount).
``--cancel-fraction`` of the requests are aborted by the client at a random output;
request ids come from a pool of ``2 × concurrency``, so each is reused many times, often
right after a kill failed it. Every ``--kill-every`` transfers one stage (in turn) is
SIGKILLed: the requests that needed it must fail with ``stage_unavailable``, new ones are
refused until it is back, then served again.

Checks, printed at the end (exit status 1 if one fails):

* every completed request got exactly its expected text and waveform (a duplicate chunk
  would show), every aborted or failed one a prefix of them — nothing delivered twice;
* every kill failed its in-flight requests and the stage came back (restart times);
* afterwards: no request state in any stage, no transfer object in the namespace; after
  shutdown nothing under /dev/shm and no worker process.

Usage, from a checkout's root: ``python -m benchmarks.soak [--transfers 100000]
[--kill-every 10000] [--cancel-fraction 0.2] [--concurrency 32] [--seed 0] [--json PATH]``.
The suite runs a reduced soak (``tests/test_bench_supervision.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.api import Pipeline, RestartPolicy
from omnirelay.connectors.shm import sweep
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import RequestFailedError, StageUnavailableError
from omnirelay.models.testing.toy import expected_counting_tokens, expected_relay_tokens, expected_waveform
from omnirelay.worker import leak_paths

PIPELINE = "toy-3stage"
#: Fast restarts for a soak: many kills, each must come back.
POLICY = RestartPolicy(max_restarts=1000, window_s=300, backoff_s=0.05, max_backoff_s=1.0)


@dataclass
class Books:
    transfers: int = 0
    completed: int = 0
    aborted: int = 0
    failed_by_kill: int = 0
    failed_other: int = 0
    refused_while_down: int = 0
    wrong_output: int = 0
    duplicate_or_wrong_prefix: int = 0
    reused_ids: int = 0
    kills: list[dict[str, Any]] = field(default_factory=list)


def _check(outs: list[Any], prompt: list[int], n: int, *, complete: bool) -> bool:
    """Outputs equal to the expected ones (complete) or a prefix of them."""
    text = expected_counting_tokens(prompt, n)
    wave = expected_waveform(expected_relay_tokens(text))
    got_text = [t for o in outs if o.modality == "text" for t in o.token_ids]
    pieces = [o.audio.reshape(-1) for o in outs if o.modality == "audio" and o.audio is not None]
    got_wave = torch.cat(pieces) if pieces else torch.zeros(0)
    if complete:
        return got_text == text and torch.equal(got_wave, wave)
    return got_text == text[: len(got_text)] and torch.equal(got_wave, wave[: got_wave.numel()])


def _difference(outs: list[Any], prompt: list[int], n: int) -> str:
    """How a request's outputs differ from the expected ones (for the report)."""
    text = expected_counting_tokens(prompt, n)
    wave = expected_waveform(expected_relay_tokens(text))
    got_text = [t for o in outs if o.modality == "text" for t in o.token_ids]
    pieces = [o.audio.reshape(-1) for o in outs if o.modality == "audio" and o.audio is not None]
    got = torch.cat(pieces) if pieces else torch.zeros(0)
    first = next((i for i, (a, b) in enumerate(zip(got_text, text)) if a != b), None)
    same = min(got.numel(), wave.numel())
    wave_at = (got[:same] != wave[:same]).nonzero()
    where = ""
    if wave_at.numel():  # which piece differs, and whose samples it carries instead
        at, start = int(wave_at[0]), 0
        for i, piece in enumerate(pieces):
            if start + piece.numel() > at:
                expected = wave[start : start + piece.numel()]
                others = [
                    j
                    for j in range(0, wave.numel() - piece.numel() + 1, max(1, piece.numel()))
                    if torch.equal(wave[j : j + piece.numel()], piece)
                ]
                where = (
                    f"; piece {i} (samples {start}..{start + piece.numel()}) is {piece.tolist()} where "
                    f"{expected.tolist()} was expected; it equals the expected samples at {others}"
                )
                break
            start += piece.numel()
    return (
        f"text {len(got_text)}/{len(text)} tokens (first difference at {first}), audio "
        f"{got.numel()}/{wave.numel()} samples in {len(pieces)} pieces (first difference at "
        f"{int(wave_at[0]) if wave_at.numel() else None}), finish {outs[-1].finish_reason if outs else None!r}, "
        f"{len(outs)} outputs{where}"
    )


class Soak:
    def __init__(self, pipe: Pipeline, args: argparse.Namespace) -> None:
        self.pipe = pipe
        self.args = args
        self.rng = random.Random(args.seed)
        self.books = Books()
        self.free_ids = [f"id{i}" for i in range(2 * args.concurrency)]
        self.used_ids: set[str] = set()
        self.next_kill = args.kill_every
        self.kill_stage = 0
        self.killing = asyncio.Lock()
        self.kill_tasks: list[asyncio.Future[None]] = []
        self.t0 = time.monotonic()
        #: Every request as it ran, for the report of a wrong output: (id, prompt, n, start, end, how).
        self.history: list[list[Any]] = []

    async def one(self) -> None:
        rid = self.free_ids.pop(self.rng.randrange(len(self.free_ids)))
        if rid in self.used_ids:
            self.books.reused_ids += 1
        self.used_ids.add(rid)
        n = self.rng.randint(self.args.min_tokens, self.args.max_tokens)
        prompt = [self.rng.randint(0, 999)]
        cancel_at = self.rng.randint(0, 2 * n) if self.rng.random() < self.args.cancel_fraction else None
        try:
            await self._run(rid, prompt, n, cancel_at)
        finally:
            self.free_ids.append(rid)

    async def _run(self, rid: str, prompt: list[int], n: int, cancel_at: int | None) -> None:
        entry: list[Any] = [rid, prompt, n, None, None, "running"]
        self.history.append(entry)
        try:
            await self._attempt(entry, rid, prompt, n, cancel_at)
        finally:
            entry[4] = self._now()

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def _attempt(
        self, entry: list[Any], rid: str, prompt: list[int], n: int, cancel_at: int | None
    ) -> None:
        while True:
            try:
                handle = self.pipe.submit(
                    prompt,
                    modalities=["text", "audio"],
                    sampling=SamplingParams(max_tokens=n),
                    request_id=rid,
                )
                entry[3] = self._now()
                break
            except StageUnavailableError:
                self.books.refused_while_down += 1
                await asyncio.to_thread(self.pipe.wait_ready, 120.0)
        outs: list[Any] = []
        if cancel_at == 0:
            handle.abort()
        try:
            async for o in handle:
                outs.append(o)
                if cancel_at is not None and len(outs) == cancel_at:
                    handle.abort()
        except StageUnavailableError:
            entry[5] = "failed by a kill"
            self.books.failed_by_kill += 1
            self._check_prefix(rid, "failed by a kill", outs, prompt, n)
            return
        except RequestFailedError as exc:
            entry[5] = "failed"
            self.books.failed_other += 1
            print(f"  {rid}: failed: {exc}", file=sys.stderr)
            return
        entry[5] = outs[-1].finish_reason
        if outs[-1].finish_reason == "abort":
            self.books.aborted += 1
            self._check_prefix(rid, "aborted", outs, prompt, n)
            return
        if not _check(outs, prompt, n, complete=True):
            self.books.wrong_output += 1
            print(f"  {rid}: wrong output: {_difference(outs, prompt, n)}", file=sys.stderr)
            self._provenance(rid, outs, prompt, n)
            return
        self.books.completed += 1
        self.books.transfers += 2 * n
        if self.books.transfers >= self.next_kill and self.books.transfers < self.args.transfers:
            self.next_kill += self.args.kill_every
            self.kill_tasks.append(asyncio.ensure_future(self.kill()))

    def _check_prefix(self, rid: str, how: str, outs: list[Any], prompt: list[int], n: int) -> None:
        if not _check(outs, prompt, n, complete=False):
            self.books.duplicate_or_wrong_prefix += 1
            print(f"  {rid} ({how}): not a prefix: {_difference(outs, prompt, n)}", file=sys.stderr)
            self._provenance(rid, outs, prompt, n)

    def _provenance(self, rid: str, outs: list[Any], prompt: list[int], n: int) -> None:
        """Which earlier request a wrong audio piece belongs to, and the kills around it."""
        wave = expected_waveform(expected_relay_tokens(expected_counting_tokens(prompt, n)))
        pieces = [o.audio.reshape(-1) for o in outs if o.modality == "audio" and o.audio is not None]
        start = 0
        for i, piece in enumerate(pieces):
            if not torch.equal(piece, wave[start : start + piece.numel()]):
                owners = []
                for other in self.history:
                    o_prompt, o_n = other[1:3]
                    o_wave = expected_waveform(expected_relay_tokens(expected_counting_tokens(o_prompt, o_n)))
                    for j in range(0, o_wave.numel() - piece.numel() + 1, piece.numel()):
                        if torch.equal(o_wave[j : j + piece.numel()], piece):
                            owners.append((other, j // piece.numel()))
                print(f"    piece {i} belongs to: {owners}", file=sys.stderr)
            start += piece.numel()
        mine = [e for e in self.history if e[0] == rid]
        print(f"    incarnations of {rid}: {mine[-4:]}", file=sys.stderr)
        print(f"    kills: {self.books.kills}", file=sys.stderr)

    async def kill(self) -> None:
        async with self.killing:
            stage_id, self.kill_stage = self.kill_stage, (self.kill_stage + 1) % self.pipe.config.num_stages
            pid = self.pipe.pids()[stage_id]
            assert pid is not None
            in_flight = self.pipe.num_active
            at_transfers = self.books.transfers
            t0 = time.monotonic()
            at_s = self._now()
            if self.args.verbose:
                print(f"  {at_s:.3f}: kill stage {stage_id}", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
            await wait_restarted(self.pipe, stage_id, pid)
            self.books.kills.append(
                {
                    "stage": stage_id,
                    "at_s": at_s,
                    "at_transfers": at_transfers,
                    "in_flight": in_flight,
                    "restart_s": round(time.monotonic() - t0, 3),
                }
            )

    async def worker(self) -> None:
        while self.books.transfers < self.args.transfers:
            await self.one()

    async def run(self) -> None:
        await asyncio.gather(*(self.worker() for _ in range(self.args.concurrency)))
        await asyncio.gather(*self.kill_tasks)  # a kill in progress finishes first


async def wait_restarted(pipe: Pipeline, stage_id: int, old_pid: int, timeout_s: float = 120.0) -> None:
    """Until the killed stage runs again in a new process: its death noticed (a new pid
    or a state other than healthy), then every stage healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = (await pipe.health_async()).stages[stage_id]
        if st.pid != old_pid or st.state != "healthy":
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"stage {stage_id}'s death was not noticed within {timeout_s:g} s")
        await asyncio.sleep(0.005)
    await asyncio.to_thread(pipe.wait_ready, timeout_s)


def audit(pipe: Pipeline) -> dict[str, Any]:
    leaks = {sid: leak_paths(state) for sid, state in pipe.leak_state().items()}
    objects = [o for o in sweep(pipe.namespace).objects if o.kind != "slot"]
    return {
        "stages_with_state": sorted(sid for sid, paths in leaks.items() if paths),
        "state_paths": {sid: paths[:5] for sid, paths in leaks.items() if paths},
        "transfer_objects": len(objects),
    }


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    pipe = Pipeline.start(PIPELINE, restart=POLICY)
    startup_s = time.monotonic() - t0
    soak = Soak(pipe, args)
    try:
        t1 = time.monotonic()
        asyncio.run(soak.run())
        wall_s = time.monotonic() - t1
        health = pipe.health()
        leaks = audit(pipe)
    finally:
        report = pipe.shutdown()
    b = soak.books
    restarts = [k["restart_s"] for k in b.kills]
    return {
        "transfers": b.transfers,
        "completed": b.completed,
        "aborted": b.aborted,
        "failed_by_kill": b.failed_by_kill,
        "failed_other": b.failed_other,
        "refused_while_down": b.refused_while_down,
        "wrong_output": b.wrong_output,
        "duplicate_or_wrong_prefix": b.duplicate_or_wrong_prefix,
        "reused_ids": b.reused_ids,
        "kills": b.kills,
        "restart_s_median": round(statistics.median(restarts), 3) if restarts else None,
        "restart_s_max": max(restarts) if restarts else None,
        "restarts_per_stage": [s.num_restarts for s in health.stages],
        "healthy_at_end": health.is_healthy,
        "startup_s": round(startup_s, 2),
        "wall_s": round(wall_s, 2),
        "transfers_per_s": round(b.transfers / wall_s, 1) if wall_s else None,
        **leaks,
        "objects_left_after_shutdown": len(sweep(pipe.namespace).objects),
        "workers_killed_at_shutdown": report.num_killed,
    }


def failures(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    bad = []
    for key in ("wrong_output", "duplicate_or_wrong_prefix", "failed_other", "transfer_objects"):
        if result[key]:
            bad.append(f"{key} = {result[key]}")
    if result["stages_with_state"]:
        bad.append(f"request state left in stages {result['stages_with_state']}")
    if result["objects_left_after_shutdown"]:
        bad.append(f"{result['objects_left_after_shutdown']} objects left after shutdown")
    expected_kills = (args.transfers - 1) // args.kill_every
    if len(result["kills"]) < expected_kills:
        bad.append(f"{len(result['kills'])} kills, expected {expected_kills}")
    if not result["healthy_at_end"]:
        bad.append("not healthy at the end")
    if result["transfers"] < args.transfers:
        bad.append(f"only {result['transfers']} transfers")
    return bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--transfers", type=int, default=100_000, help="chunk transfers to deliver (default 100000)"
    )
    p.add_argument("--kill-every", type=int, default=10_000, help="SIGKILL a stage every N transfers")
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="requests aborted by the client")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="print each kill as it happens")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_soak(args)
    for key, value in result.items():
        if key != "kills":
            print(f"{key:>28}: {value}")
    for k in result["kills"]:
        print(
            f"  kill stage {k['stage']} at {k['at_transfers']:>6} transfers "
            f"({k['in_flight']} in flight): back in {k['restart_s']:.2f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    bad = failures(result, args)
    print("PASS" if not bad else "FAIL: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
