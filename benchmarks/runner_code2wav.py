"""``omnirelay bench runner``'s stateful Code2Wav steps (:mod:`benchmarks.runner`): each
step shape with the step uncompiled and compiled by inductor inside the same CUDA graphs,
kernels per step, and the errors — of a stream decoded chunk by chunk against its
whole-utterance decode, and of the compiled step against the uncompiled one."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.runner import _pair

__all__ = [
    "CENSUS_STEP",
    "STREAM_STEPS",
    "render_stateful",
    "stateful_code2wav",
    "stream_backend",
    "tts_code2wav",
]


#: Stateful steps timed: (streams, new frames each).
STREAM_STEPS = ((1, 1), (16, 1), (64, 1), (16, 4), (64, 4), (16, 25))
#: The step whose kernels are also summed by family (device time per family, launched
#: without its graph): where a step of the target's shape spends its time.
CENSUS_STEP = (16, 4)


def stateful_code2wav(
    model: Any, reps: int, sync: Callable[[], None], backend: str | None = None
) -> dict[str, Any]:
    """The streaming steps with the step uncompiled, then compiled with ``backend``
    (None: not) inside the same graphs: each step's time, kernels per step (launched
    without the graph), and how far the compiled step's samples are from the uncompiled."""
    from omnirelay.models.runner.vocoder import CONV_SEARCH_ENV, StreamingVocoder

    device = next(model.parameters()).device
    plain = StreamingVocoder(model, max_streams=64, cuda_graphs=True)
    start = time.monotonic()
    plain.capture_graphs()
    out: dict[str, Any] = {"capture_s": time.monotonic() - start, "num_graphs": len(plain.graphs)}
    out["conv_search"] = os.environ.get(CONV_SEARCH_ENV) == "1"  # cuDNN's benchmark mode at capture
    compiled = None
    if backend is not None:
        compiled = StreamingVocoder(model, max_streams=64, cuda_graphs=True, compile=backend)
        start = time.monotonic()
        compiled.capture_graphs()
        out["compiled_capture_s"] = time.monotonic() - start
        if compiled.compile_error is None:  # no graphs (a CPU): the probe has not run
            compiled.check_compiled()
        out["compiled_startup_error"] = compiled.compile_error
        if compiled.compile_backend is None:  # the startup probe found it wrong: nothing to time
            compiled = None
    q, size = int(model.config.num_quantizers), int(model.config.codebook_size)
    with torch.inference_mode():
        for b, t in STREAM_STEPS:
            gen = torch.Generator().manual_seed(1000 * b + t)
            codes = [torch.randint(0, size, (q, t), generator=gen) for _ in range(b)]
            out[f"step_{b}x{t}"] = _stream_step(plain, compiled, codes, reps, sync)
        gen = torch.Generator().manual_seed(1)
        whole = torch.randint(0, size, (q, 120), generator=gen)
        want = model(whole.unsqueeze(0).to(device))[0, 0].float()
        out["stream_relative_error"] = _relative(_chunked(plain, whole), want)
        if compiled is not None:
            out["compiled_stream_relative_error"] = _relative(_chunked(compiled, whole), want)
    return out


def _stream_step(
    plain: Any, compiled: Any, codes: list[torch.Tensor], reps: int, sync: Callable[[], None]
) -> dict[str, Any]:
    """One step shape on both decoders: the same streams stepped again and again (each
    call one more chunk of every stream), released after; then two chunks of fresh
    streams on each decoder, compared."""
    from benchmarks.floors import count_kernels, kernel_census
    from omnirelay.models.runner.vocoder import StreamRow

    def rows(prefix: str) -> list[StreamRow]:
        return [StreamRow(f"{prefix}{i}", c) for i, c in enumerate(codes)]

    def timed(voc: Any) -> dict[str, Any]:
        figures: dict[str, Any] = _pair(voc.graphs, functools.partial(voc.decode, rows("s")), reps, sync)
        voc.graphs.bypass = True  # kernels as launched: a profiler sees a replay as one launch
        step = functools.partial(voc.decode, rows("s"))
        figures["kernels_per_step"] = count_kernels(step, sync, voc.device)
        if (len(codes), int(codes[0].shape[-1])) == CENSUS_STEP:
            figures["census"] = kernel_census(step, sync, voc.device)
        voc.graphs.bypass = False
        for row in rows("s"):
            voc.release(row.rid)
        return figures

    figures = timed(plain)
    if compiled is not None:
        more = timed(compiled)
        figures.update(
            compiled_eager_ms=more["eager_ms"],
            compiled_ms=more["graph_ms"],
            compiled_kernels_per_step=more["kernels_per_step"],
        )
        errors = []
        for _ in range(2):  # a first chunk, then a continuing one
            want, got = plain.decode(rows("c")), compiled.decode(rows("c"))
            errors += [_relative(g, w) for g, w in zip(got, want)]
        figures["compiled_relative_error"] = max(errors)
        for row in rows("c"):
            plain.release(row.rid)
            compiled.release(row.rid)
    return figures


def _chunked(voc: Any, codes: torch.Tensor) -> torch.Tensor:
    """``codes [Q, T]`` decoded as one stream in chunks of 1, 2, 4, 8 and 25 frames."""
    from omnirelay.models.runner.vocoder import StreamRow

    pieces: list[torch.Tensor] = []
    sent, sizes, total = 0, (1, 2, 4, 8, 25), int(codes.shape[-1])
    while sent < total:
        k = min(sizes[len(pieces) % len(sizes)], total - sent)
        (piece,) = voc.decode([StreamRow("exact", codes[:, sent : sent + k])])
        pieces.append(piece)
        sent += k
    voc.release("exact")
    return torch.cat(pieces).float()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def tts_code2wav(
    device: str, tiny: bool, reps: int, sync: Callable[[], None], compiled: bool = True
) -> dict[str, Any]:
    """Qwen3-TTS's 12 Hz decoder (the shipped size, random weights): its stateful steps
    (``compiled``: also through inductor, where :func:`stream_backend` compiles)."""
    from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs

    args = (
        TTSModelArgs(tiny=True, device=device) if tiny else TTSModelArgs(load_format="dummy", device=device)
    )
    codec = TTSCheckpoint.open(args).load_codec()
    return {"stateful": stateful_code2wav(codec, reps, sync, stream_backend(codec, compiled))}


def stream_backend(model: Any, compiled: bool = True) -> str | None:
    """Inductor on a GPU; nothing on the CPU (minutes of compiling for the tiny model)
    or when ``compiled`` is off (the full-size step's compile can take minutes on a card)."""
    return "inductor" if compiled and next(model.parameters()).device.type == "cuda" else None


def render_stateful(stage: str, stateful: dict[str, Any]) -> str:
    lines = [
        f"{stage}, stateful streaming steps (new frames only); compiled: the step through inductor, "
        "in the same graphs\n",
        f"{'stage':<14}{'step':<14}{'eager ms':>10}{'graph ms':>10}{'kernels':>9}"
        f"{'compiled ms':>13}{'kernels':>9}{'rel. error':>12}\n",
    ]
    for key, value in stateful.items():
        if isinstance(value, dict):
            line = (
                f"{stage:<14}{key:<14}{value['eager_ms']:>10.2f}{value['graph_ms']:>10.2f}"
                f"{value['kernels_per_step']:>9.0f}"
            )
            if "compiled_ms" in value:
                line += (
                    f"{value['compiled_ms']:>13.2f}{value['compiled_kernels_per_step']:>9.0f}"
                    f"{value['compiled_relative_error']:>12.1e}"
                )
            lines.append(line + "\n")
    compiled = ""
    if "compiled_capture_s" in stateful:
        compiled = (
            f"; compiled: compile + capture {stateful['compiled_capture_s']:.1f} s, startup probe vs "
            f"uncompiled {stateful['compiled_startup_error']:.2e}"
        )
        if "compiled_stream_relative_error" in stateful:
            compiled += f", chunked vs whole {stateful['compiled_stream_relative_error']:.2e}"
        else:
            compiled += " (over the tolerance: it fell back to uncompiled, nothing timed)"
    lines.append(
        f"{stage:<14}capture {stateful['capture_s']:.1f} s, {stateful['num_graphs']} graphs; a 120-frame "
        f"stream chunk by chunk vs whole: relative error {stateful['stream_relative_error']:.2e}{compiled}\n"
    )
    b, t = CENSUS_STEP
    census = stateful.get(f"step_{b}x{t}", {}).get("census")
    if census:
        from benchmarks.kernels import render_census

        lines.append(f"{stage}, the {b} x {t} step's kernels by family (launched without its graph):\n")
        lines.extend(line + "\n" for line in render_census({"uncompiled": census}))
    return "".join(lines)
