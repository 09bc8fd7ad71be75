"""A model of Qwen3-TTS in a device group, in virtual time: what launching by need buys.

``python -m benchmarks.group_model [--rate 20] [--duration 20] [--seed 0] [--json PATH]``

One group loop drives the Talker and Code2Wav of one GPU; each step takes the time an
H100 measured for it (docs/performance.md), and nothing runs for real: a discrete-event
simulation, seconds of CPU for a 20-second run, deterministic for a seed. What is the
product's own code: the adaptive chunk schedule (:class:`~omnirelay.processors.pacing.StreamPacer`)
and the selection by need (:class:`~omnirelay.engine.need.NeedPolicy`, with the
engine's thresholds). What is modelled:

* arrivals: Poisson at ``rate``/s, each request ``frames`` codec frames (80 ms each);
* the Talker: at most ``max_rows`` requests, one frame per row per step; a step takes
  the H100's Talker step at its row count (8.1 ms at 1 row, 13.3 at 16, 18.5 at 64,
  interpolated) plus the host's preparation;
* Code2Wav: one chunk per stream per step, ``5 ms + 0.0625 ms`` per frame in the step
  (the H100: 16 streams × 4 frames in 9.0 ms; 5.6 ms a step in a process of its own);
* the device: one step at a time at full speed; two in flight share it with the 10 %
  that stream overlap recovered in an H100 probe of the two stages' graphs (9–16 %);
* the loop: one thread; it completes what ended, launches Code2Wav, then the Talker.

Layouts (``LAYOUTS``): ``synchronous`` — the Talker steps synchronously (the loop waits
for its step, and its host copy waits for the Code2Wav kernels in flight too) and every
ready stream is stepped; ``launched`` — the Talker launches and completes by its event;
then the Talker, and Code2Wav too, choosing their steps' requests by need (the engine's
thresholds; not while requests wait for a Talker slot, as the scheduler does).

Reported per layout: first audio (arrival → the first chunk decoded) p50/p95, the share
of streams that never ran dry, the device's busy share, and the steps' mean sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import random
import statistics
from typing import Any

from omnirelay.engine.need import (
    DECODER_STEP_TOKENS,
    DECODER_URGENT_HEADROOM_S,
    FRAMES_URGENT_HEADROOM_S,
    NeedPolicy,
)
from omnirelay.processors.pacing import FrameRate, PacingConfig, StreamPacer

FRAME_S = 0.080
NUM_CODEBOOKS = 16
#: the H100's Talker step (frame + tail) by rows: ms (docs/performance.md)
TALKER_MS = ((1, 8.1), (16, 13.3), (64, 18.5))
#: the loop's host work (ms): a launch's fixed part, and per row at the launch (rows,
#: sampling draws) and at the completion (results, outputs, the chunk schedule, puts);
#: the completion's part fitted so that the synchronous layout steps the Talker as often
#: as the H100 run did (534 steps in 21.8 s at 20/s)
HOST_LAUNCH_MS = 0.5
HOST_LAUNCH_ROW_MS = 0.03
HOST_COMPLETE_ROW_MS = 0.3
DECODER_BASE_MS, DECODER_FRAME_MS = 5.0, 0.0625  # 16 streams × 4 frames: 9.0 ms
OVERLAP_GAIN = 1.10  # two steps in flight run 10 % faster together than one after the other

#: name: (the Talker launches, the Talker by need, Code2Wav by need)
LAYOUTS = {
    "synchronous": (False, False, False),
    "launched": (True, False, False),
    "launched, Talker by need": (True, True, False),
    "launched, both by need": (True, True, True),
}


def talker_ms(rows: int) -> float:
    for (r0, t0), (r1, t1) in itertools.pairwise(TALKER_MS):
        if rows <= r1:
            return t0 + (t1 - t0) * (max(rows, r0) - r0) / (r1 - r0)
    return TALKER_MS[-1][1]


@dataclasses.dataclass(eq=False)
class Stream:
    """One request: its Talker side and its Code2Wav side (each read by NeedPolicy)."""

    arrival: float
    frames: int
    pacer: StreamPacer
    made: int = 0  # frames the Talker made
    held: int = 0  # made and not yet sent
    chunks: list[int] = dataclasses.field(default_factory=list)  # sent, not yet decoded
    first_audio: float | None = None
    # NeedPolicy's view: the Talker's (frames) and Code2Wav's (audio)
    talker_first: float | None = None
    decoder: Any = None
    play_end: float = 0.0  # when the audio decoded so far has played
    worst_gap: float = 0.0


@dataclasses.dataclass(eq=False)
class DecoderSide:
    first_token_time: float | None = None
    output_seconds: float = 0.0
    output_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(eq=False)
class TalkerSide:
    stream: Stream

    @property
    def first_token_time(self) -> float | None:
        return self.stream.talker_first

    @property
    def output_token_ids(self) -> range:
        return range(self.stream.made)

    output_seconds = 0.0


@dataclasses.dataclass(eq=False)
class Step:
    stage: str
    work_ms: float
    rows: list[Stream]
    chunk_frames: list[int] = dataclasses.field(default_factory=list)
    left_ms: float = 0.0
    done: float | None = None


class Model:
    def __init__(
        self,
        *,
        launched: bool,
        talker_by_need: bool,
        decoder_by_need: bool,
        rate: float,
        duration: float,
        seed: int,
    ) -> None:
        self.launched = launched
        self.rng = random.Random(seed)
        self.arrivals: list[float] = []
        t = 0.0
        while True:
            t += self.rng.expovariate(rate)
            if t >= duration:
                break
            self.arrivals.append(t)
        self.talker_need = NeedPolicy(FRAMES_URGENT_HEADROOM_S, FRAME_S) if talker_by_need else None
        self.decoder_need = (
            NeedPolicy(DECODER_URGENT_HEADROOM_S, max_step_tokens=DECODER_STEP_TOKENS)
            if decoder_by_need
            else None
        )
        self.edge = FrameRate()
        self.max_rows = 64
        self.waiting: list[Stream] = []
        self.talking: list[Stream] = []
        self.decoding: list[Stream] = []
        self.streams: list[Stream] = []
        self.in_flight: dict[str, Step] = {}
        self.busy_ms = 0.0
        self.sizes: dict[str, list[int]] = {"talker": [], "code2wav": []}

    # ----------------------------------------------------------------- the device

    def _advance(self, now: float, until: float) -> float:
        """Run the device from ``now`` to ``until`` (or the first step's end); the time reached."""
        while now < until:
            steps = [s for s in self.in_flight.values() if s.done is None]
            if not steps:
                break
            rate = 1.0 if len(steps) == 1 else OVERLAP_GAIN / len(steps)
            first_end = now + min(s.left_ms for s in steps) / rate / 1000.0
            end = min(first_end, until)
            for s in steps:
                s.left_ms -= (end - now) * 1000.0 * rate
                if s.left_ms <= 1e-9 and s.done is None:
                    s.done = end
            self.busy_ms += (end - now) * 1000.0
            now = end
            if any(s.done is not None for s in steps):
                break
        return now

    def _run_until_done(self, now: float, names: tuple[str, ...]) -> float:
        """The synchronous Talker: the loop waits for these steps to end."""
        while any(n in self.in_flight and self.in_flight[n].done is None for n in names):
            now = self._advance(now, float("inf"))
        return now

    # ----------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        arrivals = list(self.arrivals)
        heapq.heapify(arrivals)
        now = 0.0
        while arrivals or self.waiting or self.talking or self.decoding or self.in_flight:
            while arrivals and arrivals[0] <= now:
                self._arrive(heapq.heappop(arrivals))
            for name in ("code2wav", "talker"):  # complete what ended
                step = self.in_flight.get(name)
                if step is not None and step.done is not None:
                    now = self._complete(self.in_flight.pop(name), now)
            now = self._launch_decoder(now)
            now = self._launch_talker(now)
            next_arrival = arrivals[0] if arrivals else float("inf")
            if any(s.done is None for s in self.in_flight.values()):
                now = self._advance(now, next_arrival)
            elif self.in_flight or self.talking or any(x.chunks for x in self.decoding):
                continue  # a step ended, or one can launch: the loop goes on at once
            elif next_arrival < float("inf"):
                now = max(now, next_arrival)
            else:
                break  # nothing in flight, nothing to come: the streams left are stuck
        return self._report(now)

    def _arrive(self, t: float) -> None:
        frames = self.rng.randint(20, 90)
        pacer = StreamPacer(PacingConfig(frame_s=FRAME_S), self.edge)
        stream = Stream(arrival=t, frames=frames, pacer=pacer, decoder=DecoderSide())
        self.streams.append(stream)
        self.waiting.append(stream)

    def _launch_talker(self, now: float) -> float:
        while self.waiting and len(self.talking) < self.max_rows:
            self.talking.append(self.waiting.pop(0))
        if "talker" in self.in_flight or not self.talking:
            return now
        rows = self.talking
        if self.talker_need is not None and not self.waiting:
            sides, _ = self.talker_need.select([TalkerSide(s) for s in rows], now)
            rows = [side.stream for side in sides]
        now += (HOST_LAUNCH_MS + HOST_LAUNCH_ROW_MS * len(rows)) / 1000.0
        self.sizes["talker"].append(len(rows))
        step = Step("talker", talker_ms(len(rows)), list(rows), left_ms=talker_ms(len(rows)))
        self.in_flight["talker"] = step
        if not self.launched:  # the loop waits for it, and its host copy for Code2Wav's kernels
            now = self._run_until_done(now, ("talker", "code2wav"))
            now = self._complete(self.in_flight.pop("talker"), now)
        return now

    def _launch_decoder(self, now: float) -> float:
        if "code2wav" in self.in_flight:
            return now
        ready = [s for s in self.decoding if s.chunks]
        if not ready:
            return now
        budget = None
        if self.decoder_need is not None:
            sides, urgent = self.decoder_need.select([s.decoder for s in ready], now)
            chosen = {id(side) for side in sides}
            ready = [s for s in ready if id(s.decoder) in chosen]
            if not urgent:
                budget = self.decoder_need.max_step_tokens
        rows: list[Stream] = []
        used = 0
        for s in ready:
            cost = s.chunks[0] * NUM_CODEBOOKS
            if budget is not None and rows and used + cost > budget:
                continue
            rows.append(s)
            used += cost
        for s in rows:  # round robin when the budget leaves some out
            self.decoding.remove(s)
            self.decoding.append(s)
        frames = [s.chunks.pop(0) for s in rows]
        now += (HOST_LAUNCH_MS + HOST_LAUNCH_ROW_MS * len(rows)) / 1000.0
        work = DECODER_BASE_MS + DECODER_FRAME_MS * sum(frames)
        self.sizes["code2wav"].append(sum(frames))
        self.in_flight["code2wav"] = Step("code2wav", work, rows, frames, left_ms=work)
        return now

    def _complete(self, step: Step, now: float) -> float:
        now += HOST_COMPLETE_ROW_MS * len(step.rows) / 1000.0
        if step.stage == "talker":
            for s in step.rows:
                if s.talker_first is None:
                    s.talker_first = now
                s.made += 1
                s.held += 1
                s.pacer.on_frames(now, 1)
                last = s.made >= s.frames
                if s.held and (last or s.pacer.should_send(now, s.held)):
                    s.pacer.on_sent(now, s.held)
                    s.chunks.append(s.held)
                    s.held = 0
                    if s not in self.decoding:
                        self.decoding.append(s)
                if last:
                    self.talking.remove(s)
            return now
        for s, frames in zip(step.rows, step.chunk_frames):
            audio = frames * FRAME_S
            if s.first_audio is None:
                s.first_audio = now
                s.decoder.first_token_time = now
                s.play_end = now
            elif now > s.play_end:  # the player ran dry meanwhile
                s.worst_gap = max(s.worst_gap, now - s.play_end)
                s.play_end = now
            s.play_end += audio
            s.decoder.output_seconds += audio
            if s.made >= s.frames and not s.chunks and not s.held:
                self.decoding.remove(s)
        return now

    def _report(self, end: float) -> dict[str, Any]:
        firsts = sorted((s.first_audio - s.arrival) * 1000.0 for s in self.streams if s.first_audio)
        q = statistics.quantiles(firsts, n=100)
        gap_free = sum(1 for s in self.streams if s.worst_gap <= 0.001) / len(self.streams)
        return {
            "streams": len(self.streams),
            "first_audio_ms": {"p50": round(q[49], 1), "p95": round(q[94], 1)},
            "gap_free_share": round(gap_free, 4),
            "device_busy_share": round(self.busy_ms / 1000.0 / end, 3),
            "talker_rows_mean": round(statistics.mean(self.sizes["talker"]), 1),
            "talker_steps": len(self.sizes["talker"]),
            "code2wav_frames_mean": round(statistics.mean(self.sizes["code2wav"]), 1),
            "code2wav_steps": len(self.sizes["code2wav"]),
        }


def run_model(rate: float = 20.0, duration: float = 20.0, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each layout of :data:`LAYOUTS` on the same arrivals."""
    return {
        name: Model(
            launched=launched,
            talker_by_need=talker,
            decoder_by_need=decoder,
            rate=rate,
            duration=duration,
            seed=seed,
        ).run()
        for name, (launched, talker, decoder) in LAYOUTS.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.group_model", description=__doc__)
    parser.add_argument("--rates", default="10,15,20", help="arrivals per second, comma-separated")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    results = {str(rate): run_model(rate, args.duration, args.seed) for rate in rates}
    print(
        "| rate | layout | first audio p50/p95 ms | gap-free | device busy "
        "| Talker rows/step (steps) | Code2Wav frames/step (steps) |"
    )
    print("|---|---|---|---|---|---|---|")
    for rate, layouts in results.items():
        for name, r in layouts.items():
            fa = r["first_audio_ms"]
            print(
                f"| {float(rate):g}/s | {name} | {fa['p50']:.0f}/{fa['p95']:.0f} | "
                f"{100 * r['gap_free_share']:.1f} % | {100 * r['device_busy_share']:.0f} % | "
                f"{r['talker_rows_mean']} ({r['talker_steps']}) | "
                f"{r['code2wav_frames_mean']} ({r['code2wav_steps']}) |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"duration": args.duration, "seed": args.seed, "rates": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
