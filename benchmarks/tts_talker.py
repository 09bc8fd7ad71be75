"""``omnirelay bench tts-talker``: where a Qwen3-TTS Talker step's time goes, by batch.

Builds the Talker stage exactly as the pipeline does (the shipped config with random
weights, ``load_format: dummy``, or the tiny model; the static runner with its CUDA
graphs and compiled code-predictor tail on a GPU), alone on its device, and times the
parts of one step for ``B`` continuing requests (median of ``reps``, each ended by a
device synchronization):

* **frame** — the Talker's decoder step for the ``B`` rows (the frame graph);
* **step** — a whole step as the engine calls it: the frame, the code-predictor tail
  over every row (codec head, sampling, ``Q − 1`` passes), the host's preparation and
  the device→host copy of the codes; **tail + host** is the difference;
* **admit** — a step that admits one new request (a prefill of ``prefill_tokens`` rows)
  beside ``B − 1`` continuing ones: the extra cost a new stream puts on everyone's frame.

Each batch's step also gets its **floor**: the bytes it must read (the Talker's layers,
each row's cached keys and values, the tail's code predictor once per pass and its
heads), divided by the bandwidth a device copy measured at the start of the run, the
step's time over that floor, and its kernels per step (``torch.profiler``; on the CPU
its ``aten`` operators): see :mod:`benchmarks.floors`.

With ``profile`` the steps at that batch also run under ``torch.profiler``: kernels per
step, the kernels that take the most device time, and a census of the kernels by family
(GEMM, attention, norm, sampling, inductor's, copy/index, elementwise, other:
:mod:`benchmarks.kernels`) for the frame alone, the whole step, and the step less the
frame (the code-predictor tail and the host). The rows are the runner's own
(random conditioning of the model's width, the checkpoint's sampling: temperature 0.9,
top-k 50, repetition penalty 1.05), so the figures are the model's, not a prompt's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch

from benchmarks.floors import (
    copy_bandwidth,
    count_kernels,
    floor,
    kv_bytes_per_position,
    param_bytes,
    profiled,
    talker_tail_bytes,
)
from benchmarks.kernels import census, kernel_rows, render_census, subtract
from benchmarks.runner import median_ms

__all__ = ["DEFAULT_BATCHES", "render_tts_talker_bench", "run_tts_talker_bench"]

DEFAULT_BATCHES = (1, 8, 16, 32, 48, 64)
#: the environment switches of the runner's compiled parts, recorded with the figures
_SWITCHES = ("OMNIRELAY_TAIL_", "OMNIRELAY_FRAME_")
#: positions already cached per row when a frame is timed (a conditioning plus ~2 s of speech)
CACHED = 96


def _executor(model: str, device: str, load_format: str, max_num_seqs: int) -> Any:
    from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs
    from omnirelay.models.qwen3_tts.talker import TTSTalkerExecutor

    args = TTSModelArgs(
        model=model, load_format=load_format, device=device, max_num_seqs=max_num_seqs, max_model_len=1024
    )
    return TTSTalkerExecutor.from_checkpoint(TTSCheckpoint.open(args), args)


def run_tts_talker_bench(
    *,
    model: str = "1.7b-customvoice",
    device: str = "cuda:0",
    load_format: str = "dummy",
    batches: Sequence[int] = DEFAULT_BATCHES,
    reps: int = 20,
    prefill_tokens: int = 64,
    profile: int | None = None,
    stream: TextIO | None = None,
) -> dict[str, Any]:
    """Time the Talker's step parts at each batch of ``batches`` (see the module
    docstring); ``profile``: also profile the steps at that batch. The figures as a dict."""
    from omnirelay.engine.interfaces import SamplingParams
    from omnirelay.models.runner import TalkerRow

    err = stream if stream is not None else sys.stderr
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"batches must be sizes >= 1, got {list(batches)}")
    if profile is not None and profile not in batches:
        raise ValueError(f"--profile {profile} must be one of the batches {list(batches)}")
    top = max(batches)
    start = time.monotonic()
    executor = _executor(model, device, load_format, top + 1)
    runner = executor.runner
    dev = runner.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    bandwidth = copy_bandwidth(dev)
    report: dict[str, Any] = {
        "model": model,
        "load_format": load_format,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "reps": reps,
        "prefill_tokens": prefill_tokens,
        "cached_positions": CACHED,
        "num_graphs": len(runner.graphs),
        # what runs compiled: the code-predictor tail, the frame's decoder step (its switch)
        "tail_compile": runner.predictor.compile_backend,
        "frame_compile": runner.decoder.decode_backend,
        "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_SWITCHES)},
        "ready_s": time.monotonic() - start,
        "bandwidth_bytes_per_s": bandwidth,
        "batches": {},
    }
    gen = torch.Generator().manual_seed(0)
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, seed=42)
    penalty = executor.generation.repetition_penalty

    def row(rid: str, n: int) -> TalkerRow:
        embeds = (torch.randn(n, runner.hidden, generator=gen) * 0.02).to(dev, runner.dtype)
        return TalkerRow(rid, embeds, sampled, torch.Generator().manual_seed(1), penalty, False)

    rows = [row(f"r{i}", CACHED) for i in range(top)]
    newcomer = row("new", prefill_tokens)
    with torch.inference_mode():
        for r in rows:
            runner.slots.acquire(r.rid)
        runner.prefill(rows)
        text = [row(r.rid, 1) for r in rows]
        for b in batches:
            err.write(f"bench tts-talker: batch {b}\n")
            err.flush()
            figures, frame, step = _batch(runner, rows, text, newcomer, b, reps, sync, bandwidth)
            report["batches"][str(b)] = figures
            if profile == b:
                report["profile"] = _profile(frame, step, sync, dev, b)
        for r in rows:
            runner.slots.release(r.rid)
    report["leak_state"] = executor.leak_state()
    return report


def _batch(
    runner: Any,
    rows: list[Any],
    text: list[Any],
    newcomer: Any,
    b: int,
    reps: int,
    sync: Callable[[], None],
    bandwidth: float,
) -> tuple[dict[str, float], Callable[[], None], Callable[[], None]]:
    """The figures of ``b`` continuing rows (``rows[:b]``, each rewound to ``CACHED``
    positions), and the frame and the whole step it timed (to profile)."""
    dev = runner.device
    lasts = torch.empty((b, runner.hidden), dtype=runner.dtype, device=dev)

    def rewind(b: int = b) -> None:
        for r in rows[:b]:
            runner.slots.set_length(r.rid, CACHED)

    def frame(b: int = b, lasts: torch.Tensor = lasts) -> None:
        rewind()
        runner._frame_lasts(text[:b], lasts)

    def step(b: int = b) -> None:
        rewind()
        runner.step([], text[:b])

    def admit(b: int = b) -> None:
        rewind()
        runner.slots.acquire(newcomer.rid)
        runner.step([newcomer], text[: b - 1])
        runner.slots.release(newcomer.rid)

    figures = {
        "frame_ms": median_ms(frame, reps, sync),
        "step_ms": median_ms(step, reps, sync),
        "admit_ms": median_ms(admit, reps, sync),
    }
    figures["tail_and_host_ms"] = figures["step_ms"] - figures["frame_ms"]
    figures.update(floor(_step_bytes(runner, b), bandwidth, figures["step_ms"]))
    figures["kernels_per_step"] = count_kernels(step, sync, dev, steps=2)
    return figures, frame, step


def _step_bytes(runner: Any, b: int) -> int:
    """What one step of ``b`` rows, each with ``CACHED`` positions, must read: the
    Talker's layers, final norm and the rows' keys and values (its own position's
    included), then the code-predictor tail."""
    decoder = runner.decoder
    layers = param_bytes([*decoder.layers, decoder.model.norm])
    kv = b * (CACHED + 1) * kv_bytes_per_position(decoder.model.config, runner.dtype)
    return layers + kv + talker_tail_bytes(runner)


def _profile(
    frame: Callable[[], None],
    step: Callable[[], None],
    sync: Callable[[], None],
    device: torch.device,
    b: int,
) -> dict[str, Any]:
    """Kernels per step and the largest by device time, over 5 steps of ``b`` rows; and
    the census by family (:mod:`benchmarks.kernels`) of the frame alone, the whole step
    and their difference (the code-predictor tail and the host's part)."""
    steps = 5
    on_device = device.type == "cuda"
    kernels = kernel_rows(profiled(step, sync, device, steps), on_device)
    frame_census = census(kernel_rows(profiled(frame, sync, device, steps), on_device), steps)
    step_census = census(kernels, steps)
    kernels.sort(key=lambda k: k[2], reverse=True)
    return {
        "batch": b,
        "steps": steps,
        "kernels_per_step": sum(k[1] for k in kernels) / steps,
        "device_ms_per_step": sum(k[2] for k in kernels) / steps / 1000.0,
        "top": [
            {"name": name[:120], "count_per_step": count / steps, "ms_per_step": us / steps / 1000.0}
            for name, count, us in kernels[:15]
        ],
        "census": {
            "frame": frame_census,
            "tail_and_host": subtract(step_census, frame_census),
            "step": step_census,
        },
    }


def render_tts_talker_bench(report: dict[str, Any]) -> str:
    lines = [
        f"bench tts-talker: Qwen3-TTS {report['model']} ({report['load_format']}) on {report['device']}, "
        f"torch {report['torch']}, median of {report['reps']}; {report['cached_positions']} positions cached "
        f"per row, a new request prefills {report['prefill_tokens']} rows; ready in {report['ready_s']:.1f} s "
        f"({report['num_graphs']} graphs); compiled: tail {report.get('tail_compile') or 'no'}, frame "
        f"{report.get('frame_compile') or 'no'}",
        f"bandwidth {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (a device copy, read + write); floor: the "
        "step's bytes ÷ that",
        f"{'batch':>6} {'frame ms':>9} {'tail+host ms':>13} {'step ms':>8} {'admit ms':>9} {'frames/s':>9} "
        f"{'MB read':>8} {'floor ms':>9} {'÷ floor':>8} {'kernels':>8}",
    ]
    for b, f in report["batches"].items():
        rate = int(b) / (f["step_ms"] / 1000.0) if f["step_ms"] > 0 else 0.0
        lines.append(
            f"{b:>6} {f['frame_ms']:>9.2f} {f['tail_and_host_ms']:>13.2f} {f['step_ms']:>8.2f} "
            f"{f['admit_ms']:>9.2f} {rate:>9.0f} {f['bytes'] / 1e6:>8.1f} {f['floor_ms']:>9.3f} "
            f"{f['ratio']:>7.1f}x {f['kernels_per_step']:>8.0f}"
        )
    prof = report.get("profile")
    if prof:
        lines.append(
            f"profile at batch {prof['batch']}: {prof['kernels_per_step']:.0f} kernels and "
            f"{prof['device_ms_per_step']:.2f} ms of kernel time per step; largest:"
        )
        for k in prof["top"]:
            lines.append(f"  {k['ms_per_step']:>8.3f} ms {k['count_per_step']:>6.0f}x  {k['name']}")
        if "census" in prof:
            lines.append("kernels per step by family (frame alone; the whole step less the frame; the step):")
            lines.extend(render_census(prof["census"]))
    left = report.get("leak_state")
    lines.append("state left: none" if not left else f"state left: {left}")
    return "\n".join(lines)
