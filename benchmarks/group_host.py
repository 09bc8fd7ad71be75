"""The host work per row of a device group's loop, on the CPU: what one step costs besides the device.

``python -m benchmarks.group_host [--rows 32,64] [--steps 300] [--parts] [--profile N] [--json PATH]``

The qwen3-tts pipeline's Talker and Code2Wav as one device group
(:class:`~omnirelay.worker.group.GroupLoop` over their
:class:`~omnirelay.worker.loop.WorkerLoop` s), everything the product's own code but the
two executors: the stages' engines and schedulers, the Talker → Code2Wav chunk processor
with the shipped edge's schedule, the in-process edge by reference, the worker loops'
outputs encoded as the control socket would send them. The executors are fakes that cost
nothing on the device: the Talker's launch hands back each row's frame (a precomputed
``[1, Q]`` slice; codec EOS after the request's length), Code2Wav's the precomputed
samples of the chunk's new frames; a launched step is done once its H100 step time
passed (the Talker 8.1 ms at one row to 18.5 ms at 64, Code2Wav 5 ms + 0.0625 ms a
frame, docs/performance.md), so the loop overlaps and waits as it would on the card.

A front keeps ``rows`` requests in the Talker: each ends with its codec EOS after 20–90
frames (seeded), is then submitted anew under a new id, and is released on both stages
once Code2Wav's last output came.

Reported per row count: the loop thread's CPU time, and the whole process's (the send
lanes build and put the chunks on threads of their own), per Talker row and step — the
``host work per row`` of the group model (:mod:`benchmarks.group_model`); the bench's
front runs on the loop's thread and its CPU time is left out of both. With
``--parts`` each part of the loop is timed (a few microseconds of timer per call are
charged to it); ``--profile N`` prints the loop thread's N costliest functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from omnirelay.connectors.inproc import InprocConnector
from omnirelay.engine import StageEngine
from omnirelay.engine.interfaces import BatchItem, ItemResult, SamplingParams, StageRequest
from omnirelay.pipeline import load_pipeline
from omnirelay.pipeline.config import PipelineConfig
from omnirelay.processors.codec_input import read_codec_chunk
from omnirelay.transfer import TransferConfig
from omnirelay.worker.factory import default_registry
from omnirelay.worker.group import GroupLoop
from omnirelay.worker.loop import WorkerLoop
from omnirelay.worker.messages import (
    Outputs,
    Release,
    Released,
    Submit,
    ToFront,
    decode_to_front,
    encode_message,
    stage_output,
    wire_request,
)
from omnirelay.worker.spec import WorkerSpec
from omnirelay.worker.worker_control import CommandInbox, ControlPaths

__all__ = ["HostRun", "main", "run_host_bench"]

NUM_CODEBOOKS = 16
CODEC_EOS = 2150
SAMPLES_PER_FRAME = 1920
_NAMESPACES = itertools.count()


def talker_step_s(rows: int) -> float:
    """The H100's Talker step (frame + tail) at ``rows`` rows, interpolated."""
    points = ((1, 8.1), (16, 13.3), (64, 18.5))
    for (r0, t0), (r1, t1) in itertools.pairwise(points):
        if rows <= r1:
            return (t0 + (t1 - t0) * (max(rows, r0) - r0) / (r1 - r0)) / 1000.0
    return 18.5 / 1000.0


def code2wav_step_s(frames: int) -> float:
    return (5.0 + 0.0625 * frames) / 1000.0


class _Timed:
    """A launched fake step: done once its device time passed."""

    __slots__ = ("_done_at", "_results")

    def __init__(self, results: list[ItemResult], seconds: float) -> None:
        self._results = results
        self._done_at = time.perf_counter() + seconds

    def is_done(self) -> bool:
        return time.perf_counter() >= self._done_at

    def result(self) -> list[ItemResult]:
        return self._results


class FakeTalker:
    """The Talker's executor, free on the device: one frame per row, EOS at the request's length."""

    execution_type = "ar"
    supports_batching = True

    def __init__(self, lengths: dict[str, int], *, device_time: bool = True) -> None:
        self._lengths = lengths
        self._frames: dict[str, int] = {}
        self._device_time = device_time
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 2048, (128, NUM_CODEBOOKS), generator=gen)
        #: precomputed frames (``[1, Q]``, one tensor each, as the executor hands them) and their first codes
        self._frames_pool = [codes[i : i + 1].clone() for i in range(128)]
        self._firsts = [int(c) for c in codes[:, 0]]
        self._eos = torch.zeros(1, NUM_CODEBOOKS, dtype=torch.long)
        self._eos[0, 0] = CODEC_EOS
        self.num_rows = 0
        self.num_steps = 0

    def launch(self, batch: list[BatchItem]) -> _Timed:
        results = []
        for i, item in enumerate(batch):
            n = self._frames.get(item.internal_id, 0)
            if n >= self._lengths[item.external_id]:
                results.append(
                    ItemResult(
                        internal_id=item.internal_id,
                        token_ids=[CODEC_EOS],
                        finished=True,
                        next_stage_output=self._eos,
                    )
                )
                continue
            self._frames[item.internal_id] = n + 1
            k = (i + n) % 128
            results.append(
                ItemResult(
                    internal_id=item.internal_id,
                    token_ids=[self._firsts[k]],
                    next_stage_output=self._frames_pool[k],
                )
            )
        self.num_rows += len(batch)
        self.num_steps += 1
        return _Timed(results, talker_step_s(len(batch)) if self._device_time else 0.0)

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:  # pragma: no cover - launch is used
        return self.launch(batch).result()

    def release(self, internal_id: str) -> None:
        self._frames.pop(internal_id, None)

    def leak_state(self) -> dict[str, Any]:
        return {"frames": sorted(self._frames)} if self._frames else {}


class FakeCode2Wav:
    """Code2Wav's executor, free on the device: the chunk's new frames as precomputed samples."""

    execution_type = "generation"
    supports_batching = True
    read_chunk = staticmethod(read_codec_chunk)

    def __init__(self, *, device_time: bool = True) -> None:
        self._audio = torch.zeros(SAMPLES_PER_FRAME * 128, dtype=torch.float32)
        self._device_time = device_time
        self.num_rows = 0
        self.num_steps = 0
        self.num_frames = 0

    def launch(self, batch: list[BatchItem]) -> _Timed:
        results = []
        frames = 0
        for item in batch:
            info = item.additional_information
            left = info.meta.left_context_size if info is not None and info.meta is not None else 0
            n = max(0, len(item.input_token_ids) // NUM_CODEBOOKS - (left or 0))
            frames += n
            results.append(
                ItemResult(
                    internal_id=item.internal_id,
                    audio=self._audio[: n * SAMPLES_PER_FRAME],
                    sample_rate=24_000,
                )
            )
        self.num_rows += len(batch)
        self.num_steps += 1
        self.num_frames += frames
        return _Timed(results, code2wav_step_s(frames) if self._device_time else 0.0)

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:  # pragma: no cover - launch is used
        return self.launch(batch).result()

    def release(self, internal_id: str) -> None:
        pass

    def leak_state(self) -> dict[str, Any]:
        return {}


class Parts:
    """Thread CPU time per part, exclusive of the timed parts inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def wrap(self, obj: Any, name: str, part: str) -> None:
        inner = getattr(obj, name)
        local = self._local

        def timed(*args: Any, **kw: Any) -> Any:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = [0.0]
            stack.append(0.0)
            start = time.thread_time()
            try:
                return inner(*args, **kw)
            finally:
                spent = time.thread_time() - start
                nested = stack.pop()
                stack[-1] += spent
                with self._lock:
                    self.seconds[part] = self.seconds.get(part, 0.0) + spent - nested
                    self.calls[part] = self.calls.get(part, 0) + 1

        setattr(obj, name, timed)


class HostRun:
    """The two stages as one group, a front that keeps ``rows`` requests in the Talker."""

    def __init__(
        self, rows: int, *, seed: int = 0, device_time: bool = True, parts: Parts | None = None
    ) -> None:
        self.rows = rows
        self._rng = random.Random(seed)
        self.pipeline = _bench_pipeline(rows, f"gh{os.getpid()}x{next(_NAMESPACES)}")
        self.lengths: dict[str, int] = {}
        self.talker = FakeTalker(self.lengths, device_time=device_time)
        self.code2wav = FakeCode2Wav(device_time=device_time)
        registry = default_registry()
        processor = registry.processors.get("talker_to_code2wav")(self.pipeline.stage(0), self.pipeline)
        ns = self.pipeline.namespace
        assert ns is not None
        self.connectors = [InprocConnector(ns, s, by_reference=True) for s in (0, 1)]
        self.engines = [
            StageEngine(
                s,
                self.pipeline,
                executor,
                self.connectors[s],
                processor=processor if s == 0 else None,
                transfer_config=TransferConfig(stage_id=s),
            )
            for s, executor in ((0, self.talker), (1, self.code2wav))
        ]
        paths = ControlPaths(directory="/nonexistent", num_workers=3)
        self.members = [
            WorkerLoop(
                e, CommandInbox(), self._send, WorkerSpec(e.stage_id, self.pipeline, paths, os.getpid())
            )
            for e in self.engines
        ]
        self.group = GroupLoop(self.members, poll_s=0.0002)
        self._front: list[ToFront] = []
        self._ids = itertools.count()
        self.num_done = 0
        self.num_bytes_out = 0
        self.front_s = 0.0
        #: the front's books: samples of audio per request, the requests whose audio ended
        self.samples: dict[str, int] = {}
        self.done: list[str] = []
        if parts is not None:
            self._wrap(parts, processor)
        for _ in range(rows):
            self._submit()

    def _wrap(self, parts: Parts, processor: Any) -> None:
        for member in self.members:
            parts.wrap(member, "take_messages", "control messages")
            parts.wrap(member, "is_step_done", "poll")
            parts.wrap(member, "launch", "launch: schedule, batch")
            parts.wrap(member, "complete", "complete: results, outputs, chunks")
            parts.wrap(member, "_send_step", "outputs: wire, encode, send")
            parts.wrap(member, "_answer", "control messages")
        for engine in self.engines:
            parts.wrap(engine, "load_deferred", "register chunk loads")
            parts.wrap(engine, "take_released", "outputs: wire, encode, send")
            adapter = engine._adapter
            assert adapter is not None
            parts.wrap(adapter, "save_async", "complete: save chunk (admit)")
            parts.wrap(adapter, "poll_events", "launch: transfer events")
        parts.wrap(self.talker, "launch", "fake executors")
        parts.wrap(self.code2wav, "launch", "fake executors")
        parts.wrap(processor, "build", "lanes: chunk build")
        for conn in self.connectors:
            parts.wrap(conn, "put", "lanes: put")
            parts.wrap(conn, "get", "lanes: get")

    # ----------------------------------------------------------------- the front

    def _submit(self) -> None:
        rid = f"r{next(self._ids)}"
        self.lengths[rid] = self._rng.randint(20, 90)
        prompt = list(range(12))
        self.members[0].inbox.put(
            Submit(
                wire_request(
                    StageRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling=SamplingParams(max_tokens=2048, stop_token_ids=(CODEC_EOS,)),
                        final_stage_id=1,
                    )
                )
            )
        )
        self.members[1].inbox.put(
            Submit(
                wire_request(
                    StageRequest(request_id=rid, prompt_token_ids=[0], is_placeholder=True, final_stage_id=1)
                )
            )
        )

    def _send(self, message: ToFront) -> None:
        data = encode_message(message)  # what the control socket sends
        self.num_bytes_out += len(data)
        self._front.append(message)

    def _serve_front(self) -> None:
        """What the front does with the loop's messages (another process: its CPU time
        is kept apart, ``front_s``)."""
        start = time.thread_time()
        try:
            self._front_step()
        finally:
            self.front_s += time.thread_time() - start

    def _front_step(self) -> None:
        messages, self._front = self._front, []
        for message in messages:
            decode_to_front(encode_message(message))
            if isinstance(message, Outputs):
                for out in message.outputs:
                    if out.error is not None:
                        raise RuntimeError(f"stage {out.stage_id}: {out.request_id}: {out.error}")
                    if out.stage_id == 1 and out.audio is not None:
                        audio = stage_output(out).audio
                        self.samples[out.request_id] = self.samples.get(out.request_id, 0) + audio.numel()
                    if not out.finished:
                        continue
                    if out.stage_id == 0:
                        self._submit()
                    else:
                        self.num_done += 1
                        self.done.append(out.request_id)
                        for member in self.members:
                            member.inbox.put(Release(out.request_id))
            elif isinstance(message, Released):
                pass

    def run_steps(self, num_steps: int) -> None:
        """Until the Talker stepped ``num_steps`` more times."""
        until = self.talker.num_steps + num_steps
        deadline = time.monotonic() + 600
        while self.talker.num_steps < until:
            self.group.run_once()
            self._serve_front()
            if time.monotonic() > deadline:
                raise RuntimeError("the group made no progress")

    def run_until(self, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Until ``done()`` (the send lanes deliver chunks on threads of their own: a
        Talker that costs nothing may step far ahead of them)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError("the group did not get there in time")
            self.group.run_once()
            self._serve_front()

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()


def _bench_pipeline(rows: int, namespace: str) -> PipelineConfig:
    """The shipped qwen3-tts, its Talker and Code2Wav as one group with room for ``rows``
    requests and those that still finish their audio."""
    pipeline = load_pipeline("qwen3-tts")
    cap = 2 * rows + 8
    stages = tuple(
        msgspec.structs.replace(s, max_num_seqs=cap) if s.id in (0, 1) else s for s in pipeline.stages
    )
    return msgspec.structs.replace(pipeline, stages=stages, namespace=namespace)


def measure(
    rows: int, *, steps: int, warmup: int = 40, seed: int = 0, parts: bool = False, profile: int = 0
) -> dict[str, Any]:
    """One row count: the loop's CPU per Talker row and step, overall and (``parts``) by part."""
    timer = Parts() if parts else None
    run = HostRun(rows, seed=seed, parts=timer)
    try:
        run.run_steps(warmup)
        if timer is not None:
            timer.seconds.clear()
            timer.calls.clear()
        t_rows, c_rows, c_steps, c_frames = (
            run.talker.num_rows,
            run.code2wav.num_rows,
            run.code2wav.num_steps,
            run.code2wav.num_frames,
        )
        front = run.front_s
        prof = cProfile.Profile(time.thread_time) if profile else None
        wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
        if prof is not None:
            prof.enable()
        run.run_steps(steps)
        if prof is not None:
            prof.disable()
        wall = time.perf_counter() - wall
        front = run.front_s - front
        thread = time.thread_time() - thread - front
        process = time.process_time() - process - front
        row_steps = run.talker.num_rows - t_rows
        out: dict[str, Any] = {
            "rows": rows,
            "talker_steps": steps,
            "talker_rows_per_step": row_steps / steps,
            "code2wav_steps": run.code2wav.num_steps - c_steps,
            "code2wav_rows_per_step": (run.code2wav.num_rows - c_rows)
            / max(1, run.code2wav.num_steps - c_steps),
            "code2wav_frames_per_step": (run.code2wav.num_frames - c_frames)
            / max(1, run.code2wav.num_steps - c_steps),
            "wall_ms_per_talker_step": 1000 * wall / steps,
            "loop_thread_us_per_row_step": 1e6 * thread / row_steps,
            "front_us_per_row_step": 1e6 * front / row_steps,
            "process_us_per_row_step": 1e6 * process / row_steps,
            "requests_done": run.num_done,
        }
        if timer is not None:
            out["parts_us_per_row_step"] = {
                k: round(1e6 * v / row_steps, 2)
                for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])
            }
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(profile)
            out["profile"] = text.getvalue()
        return out
    finally:
        run.close()


def run_host_bench(
    rows: tuple[int, ...] = (32, 64), *, steps: int = 300, parts: bool = False, profile: int = 0
) -> list[dict[str, Any]]:
    return [measure(r, steps=steps, parts=parts, profile=profile) for r in rows]


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| rows | Talker rows/step | loop thread µs/row/step | process µs/row/step | Code2Wav rows/step (frames) "
        "| wall ms/Talker step |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['talker_rows_per_step']:.1f} | {r['loop_thread_us_per_row_step']:.1f} | "
            f"{r['process_us_per_row_step']:.1f} | "
            f"{r['code2wav_rows_per_step']:.1f} ({r['code2wav_frames_per_step']:.1f}) | "
            f"{r['wall_ms_per_talker_step']:.1f} |"
        )
    for r in results:
        if "parts_us_per_row_step" in r:
            lines.append(f"\nparts at {r['rows']} rows, µs per Talker row and step:")
            lines += [f"  {k:40s} {v:8.2f}" for k, v in r["parts_us_per_row_step"].items()]
        if "profile" in r:
            lines.append(r["profile"])
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, emit: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.group_host", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", default="32,64", help="Talker rows per step, comma-separated")
    parser.add_argument("--steps", type=int, default=300, help="Talker steps measured per row count")
    parser.add_argument("--parts", action="store_true", help="time each part of the loop")
    parser.add_argument(
        "--profile", type=int, default=0, help="print the loop thread's N costliest functions"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = tuple(int(r) for r in args.rows.split(","))
    results = run_host_bench(rows, steps=args.steps, parts=args.parts, profile=args.profile)
    emit(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"results": [{k: v for k, v in r.items() if k != "profile"} for r in results]}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
