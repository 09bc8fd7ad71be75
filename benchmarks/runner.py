"""``omnirelay bench runner``: each stage's step time on a GPU, eager vs CUDA graphs.

Builds the full-size Qwen3-Omni parts with random weights (``load_format: dummy``) on
one device, one stage at a time, on the static runner with the shapes the pipeline
benchmark meets, and times each step as the stage engine calls it (host preparation,
the forward pass, the device→host copy of the results), median of ``reps`` runs:

* Thinker — prefill of one 30-token prompt and of 16 and 64 prompts in one launch;
  decode steps of 1, 16 and 64 rows;
* Talker — prefill + first frame of 1 and 16 requests (40 conditioning rows each); a
  whole frame (Talker step + 15 code-predictor steps) of 1, 16 and 64 rows; then the same
  frames with the code-predictor tail compiled (``torch.compile``, inductor) and captured
  in the graphs, its compile time, and how many greedy codes the two tails agree on;
* Code2Wav — windows of 4, 29 and 50 frames (one stream), 50 frames x 16 streams; then
  steps of the stateful streaming decoder (each stream's new frames only, with its
  state): 1 frame x 1 / 16 / 64 streams, 4 x 16 / 64, 25 x 16, each with its kernels per
  step, and a 120-frame stream decoded chunk by chunk against its whole-utterance decode
  (relative error); then the same with the step compiled by inductor inside its graphs
  (its compile time, and its samples against the uncompiled step's);
* ``tts-code2wav`` — the same stateful steps for Qwen3-TTS's 12 Hz decoder (not in the
  default stages of ``omnirelay bench runner``).

Each figure is taken with the graphs bypassed (the same code run eagerly) and replayed.
The Thinker's steps and the Talker's frames also get their **floor**
(:mod:`benchmarks.floors`): the bytes the step must read (the layers' weights, the
experts its batch routes to — distinct experts per layer from the routers' top-k in an
eager pass — and each row's cached keys and values), the bandwidth a device copy
measured at the start of the run, the floor (bytes ÷ bandwidth), the graph time over
the floor, and the step's kernels (``torch.profiler``).
The Thinker's report names its experts implementation (``experts``: the fused Triton
path of :mod:`omnirelay.models.runner.moe`, or with ``OMNIRELAY_FUSED_MOE=0``
``transformers``' own, for a before/after on one machine), and each figure the paths
that actually ran, counted per call in an eager pass (``fused_block``,
``fused_experts``, ``fallback``, or ``transformers``' implementation by name).
The graphs' capture time is reported per stage, and the eager/graph agreement: the
Thinker's greedy ids and the Talker's greedy codes must be equal.
With ``OMNIRELAY_THINKER_COMPILE=1`` the Thinker's decode launches run compiled
(inductor) in its graphs: its report names the backend (``decode_compile``), its capture
time includes the compile, and ``compiled_ids_agreement`` is the share of a 16-row
decode's greedy ids the compiled graphs pick as the uncompiled pass does; the floors'
routing and the experts paths are taken from the uncompiled pass (the same weights, and
its calls are counted). The report's ``switches`` are the runner's environment switches
the run saw, so runs with a switch on and off compare.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.floors import (
    RoutedExperts,
    copy_bandwidth,
    count_kernels,
    floor,
    kv_bytes_per_position,
    param_bytes,
    talker_tail_bytes,
)

__all__ = ["median_ms", "render_runner_bench", "run_runner_bench"]

PROMPT_TOKENS = 30
TALKER_ROWS = 40
#: the environment switches of the runner's compiled and fused parts, recorded with the figures
SWITCHES = (
    "OMNIRELAY_THINKER_",
    "OMNIRELAY_FRAME_",
    "OMNIRELAY_TAIL_",
    "OMNIRELAY_FUSED_MOE",
    "OMNIRELAY_CODE2WAV_",
)


def median_ms(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``reps`` calls of ``fn`` in ms, each ended by ``sync()``, after
    one uncounted call."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times)


def _pair(graphs: Any, fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> dict[str, float]:
    graphs.bypass = True
    eager = median_ms(fn, max(3, reps // 4), sync)
    graphs.bypass = False
    graph = median_ms(fn, reps, sync)
    return {"eager_ms": eager, "graph_ms": graph, "speedup": eager / graph if graph > 0 else 0.0}


def _build_s(model: Any) -> float:
    """Seconds the dummy weights took to build (0 for a model loaded otherwise)."""
    build = getattr(model, "omnirelay_build", None)
    return float(build.seconds) if build is not None else 0.0


def _with_floor(
    figures: dict[str, float],
    graphs: Any,
    fn: Callable[[], Any],
    model: Any,
    fixed_bytes: int,
    bandwidth: float,
    sync: Callable[[], None],
    device: torch.device,
) -> dict[str, float]:
    """``figures`` plus the step's floor and kernels: ``fixed_bytes`` (dense weights, KV)
    and the experts one eager pass of ``fn`` routes to under ``model``."""
    graphs.bypass = True
    with RoutedExperts(model) as routed:
        fn()
    graphs.bypass = False
    figures.update(floor(fixed_bytes + routed.nbytes(), bandwidth, figures["graph_ms"]))
    if len(routed):
        figures["experts_per_layer"] = sum(routed.distinct) / len(routed)
    figures["kernels_per_step"] = count_kernels(fn, sync, device, steps=2)
    return figures


def _experts_paths(graphs: Any, fn: Callable[[], Any], model: torch.nn.Module) -> dict[str, int]:
    """Which experts path one eager pass of ``fn`` took, as calls per path (a graph's
    replay runs the path its capture took, which is this pass's): ``fused_block`` (a whole
    MoE block, :func:`~omnirelay.models.runner.moe.fused_moe_block`), ``fused_experts``
    (an experts call through the fused kernels), ``fallback`` (an experts call the fused
    path handed back to ``transformers``), and any other implementation's calls by its
    name (``grouped_mm``, ``batched_mm``). Counted from the calls themselves, so a path
    that quietly stops running shows here."""
    from benchmarks.floors import is_experts
    from omnirelay.models.runner import moe

    banks = [m for m in model.modules() if is_experts(m)]
    other: Counter[str] = Counter()

    def counted(bank: Any) -> Callable[..., Any]:
        forward = bank.forward

        def call(*args: Any, **kwargs: Any) -> Any:
            name = str(bank.config._experts_implementation)
            if name != moe.FUSED_EXPERTS:
                other[name] += 1
            return forward(*args, **kwargs)

        return call

    before = Counter(moe.CALLS)
    own = [vars(bank).get("forward") for bank in banks]  # an instance's own forward, if any
    for bank in banks:  # an attribute, not a hook: a hook turns the block path off
        bank.forward = counted(bank)
    graphs.bypass = True
    try:
        fn()
    finally:
        graphs.bypass = False
        for bank, forward in zip(banks, own, strict=True):
            del bank.forward
            if forward is not None:
                bank.forward = forward
    fused = moe.CALLS - before
    paths = {"fused_block": fused["block"], "fused_experts": fused["experts"], "fallback": fused["fallback"]}
    return {name: n for name, n in {**paths, **other}.items() if n}


@contextmanager
def _uncompiled(decoder: Any) -> Iterator[None]:
    """``decoder``'s decode launches run its uncompiled pass for the duration."""
    compiled = decoder.decode_forward
    decoder.decode_forward = decoder.forward
    try:
        yield
    finally:
        decoder.decode_forward = compiled


def _thinker_runner(checkpoint: Any, model: Any) -> Any:
    """The Thinker's static runner as the bench times it; its decode compiled as
    ``OMNIRELAY_THINKER_COMPILE`` says, with the stage's on-disk kernel cache."""
    from omnirelay.models.prepared import cache_root
    from omnirelay.models.runner import Buckets, ThinkerRunner
    from omnirelay.models.runner.predictor import use_compile_cache
    from omnirelay.models.runner.thinker import decode_compile_backend

    text = getattr(model.model, "language_model", model.model)
    compile = decode_compile_backend(text.embed_tokens.weight.device, True)
    if compile == "inductor":
        use_compile_cache(cache_root())
    buckets = Buckets(max_num_seqs=64, max_model_len=1024, batch_sizes=(1, 16, 64), prefill_tokens=(64,))
    return ThinkerRunner(
        text,
        model.lm_head,
        capture_layers=(0, int(checkpoint.config.talker_config.accept_hidden_layer)),
        num_text_ids=256,
        buckets=buckets,
        cuda_graphs=True,
        compile=compile,
    )


def _thinker(
    checkpoint: Any, reps: int, sync: Callable[[], None], bandwidth: float, sizes: tuple[int, ...]
) -> dict[str, Any]:
    from omnirelay.engine.interfaces import SamplingParams
    from omnirelay.models.runner import Row
    from omnirelay.models.runner.thinker import experts_for

    model = checkpoint.load_thinker()
    text = getattr(model.model, "language_model", model.model)
    runner = _thinker_runner(checkpoint, model)
    start = time.monotonic()
    runner.capture_graphs()
    out: dict[str, Any] = {
        "build_s": _build_s(model),
        "capture_s": time.monotonic() - start,  # with the decode's compile when it is on
        "num_graphs": len(runner.graphs),
        # the experts implementation asked for (OMNIRELAY_FUSED_MOE=0: transformers' own);
        # each figure's ``experts`` counts the paths that ran
        "experts": experts_for(runner.device, runner.dtype, 2, 1),
        # the decode launches' torch.compile backend (OMNIRELAY_THINKER_COMPILE=1: inductor)
        "decode_compile": runner.decoder.decode_backend,
    }
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams()
    rows = [
        Row(
            f"r{i}",
            0,
            torch.randint(0, 256, (PROMPT_TOKENS,), generator=gen).tolist(),
            greedy,
            torch.Generator(),
        )
        for i in range(64)
    ]
    for row in rows:
        runner.slots.acquire(row.rid)
    hidden = int(text.config.hidden_size) * runner.dtype.itemsize
    dense = param_bytes([*runner.decoder.layers, text.norm, model.lm_head])
    per_position = kv_bytes_per_position(text.config, runner.dtype)
    with torch.inference_mode():
        for n in sizes:
            fn = functools.partial(runner.run, rows[:n], decode=False)
            out[f"prefill_{n}x{PROMPT_TOKENS}"] = _with_floor(
                _pair(runner.graphs, fn, reps, sync),
                runner.graphs,
                fn,
                text,
                dense + n * PROMPT_TOKENS * hidden,  # a fresh prompt reads no cache
                bandwidth,
                sync,
                runner.device,
            )
            out[f"prefill_{n}x{PROMPT_TOKENS}"]["experts"] = _experts_paths(runner.graphs, fn, text)
        runner.run(rows, decode=False)
        for n in sizes:
            step = [Row(r.rid, PROMPT_TOKENS, [5], greedy, r.generator) for r in rows[:n]]
            fn = functools.partial(runner.run, step, decode=True)
            figures = _pair(runner.graphs, fn, reps, sync)
            with _uncompiled(runner.decoder):  # the eager passes: the model's routing, counted
                out[f"decode_{n}"] = _with_floor(
                    figures,
                    runner.graphs,
                    fn,
                    text,
                    dense + n * (hidden + (PROMPT_TOKENS + 1) * per_position),
                    bandwidth,
                    sync,
                    runner.device,
                )
                out[f"decode_{n}"]["experts"] = _experts_paths(runner.graphs, fn, text)
        step = [Row(r.rid, PROMPT_TOKENS, [5], greedy, r.generator) for r in rows[:16]]
        runner.graphs.bypass = True
        eager_ids = [o.token for o in runner.run(step, decode=True)]
        with _uncompiled(runner.decoder):
            plain_ids = [o.token for o in runner.run(step, decode=True)]
        runner.graphs.bypass = False
        graph_ids = [o.token for o in runner.run(step, decode=True)]
        out["greedy_ids_equal"] = eager_ids == graph_ids
        if runner.decoder.decode_backend is not None:
            same = sum(a == b for a, b in zip(plain_ids, graph_ids, strict=True))
            out["compiled_ids_agreement"] = same / len(graph_ids)
    return out


def _talker_runner(model: Any, config: Any, compile: str | None) -> tuple[Any, float]:
    from omnirelay.models.runner import Buckets, TalkerRunner

    buckets = Buckets(max_num_seqs=64, max_model_len=1024, batch_sizes=(1, 16, 64), prefill_tokens=(64,))
    runner = TalkerRunner(
        model,
        codebook_size=int(config.code_predictor_config.vocab_size),
        codec_eos=int(config.codec_eos_token_id),
        num_code_groups=int(config.num_code_groups),
        buckets=buckets,
        cuda_graphs=True,
        compile=compile,
    )
    start = time.monotonic()
    runner.capture_graphs()
    return runner, time.monotonic() - start


def _talker(
    checkpoint: Any, reps: int, sync: Callable[[], None], bandwidth: float, sizes: tuple[int, ...]
) -> dict[str, Any]:
    from omnirelay.engine.interfaces import SamplingParams
    from omnirelay.models.runner import TalkerRow

    model = checkpoint.load_talker()
    config = checkpoint.config.talker_config
    runner, capture_s = _talker_runner(model, config, None)
    out: dict[str, Any] = {
        "build_s": _build_s(model),
        "capture_s": capture_s,
        "num_graphs": len(runner.graphs),
    }
    hidden = int(config.text_config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    sampled = SamplingParams(temperature=0.9, seed=42)

    def row(rid: str, n: int) -> TalkerRow:
        embeds = (torch.randn(n, hidden, generator=gen) * 0.02).to(runner.device, runner.dtype)
        return TalkerRow(rid, embeds, sampled, torch.Generator().manual_seed(1))

    rows = [row(f"r{i}", TALKER_ROWS) for i in range(64)]
    for r in rows:
        runner.slots.acquire(r.rid)
    with torch.inference_mode():
        for n in (n for n in sizes if n <= 16):
            out[f"prefill_{n}x{TALKER_ROWS}"] = _pair(
                runner.graphs, functools.partial(runner.prefill, rows[:n]), reps, sync
            )
        runner.prefill(rows)
        text = [row(r.rid, 1).embeds for r in rows]
        decoder = runner.decoder.model
        dense = param_bytes([*runner.decoder.layers, decoder.norm]) + talker_tail_bytes(runner)
        per_position = kv_bytes_per_position(decoder.config, runner.dtype)
        for n in sizes:

            def frame(n: int = n) -> torch.Tensor:
                for r in rows[:n]:
                    runner.slots.set_length(r.rid, TALKER_ROWS)
                return runner.decode(
                    [TalkerRow(r.rid, t, r.sampling, r.generator) for r, t in zip(rows[:n], text)]
                )

            out[f"frame_{n}"] = _with_floor(
                _pair(runner.graphs, frame, reps, sync),
                runner.graphs,
                frame,
                decoder,
                dense + n * (TALKER_ROWS + 1) * per_position,
                bandwidth,
                sync,
                runner.device,
            )
        greedy = [TalkerRow(r.rid, t, SamplingParams(), r.generator) for r, t in zip(rows[:16], text)]
        codes = {}
        previous = runner._codec_embed.clone()  # each frame's input: the last frame's codes
        for bypass in (True, False):
            runner.graphs.bypass = bypass
            runner._codec_embed.copy_(previous)
            for r in rows[:16]:
                runner.slots.set_length(r.rid, TALKER_ROWS)
            codes[bypass] = runner.decode(greedy)
        runner.graphs.bypass = False
        out["greedy_codes_equal"] = bool(torch.equal(codes[True], codes[False]))
        if runner.device.type != "cuda":
            return out  # the compiled tail's figures are a card's (inductor on the CPU: minutes)
        out["compiled"] = _compiled_frames(
            runner, model, config, rows, text, reps, sync, previous, codes[False]
        )
    return out


def _compiled_frames(
    plain: Any,
    model: Any,
    config: Any,
    rows: list[Any],
    text: list[torch.Tensor],
    reps: int,
    sync: Callable[[], None],
    previous: torch.Tensor,
    plain_codes: torch.Tensor,
) -> dict[str, Any]:
    """The frames of ``plain`` (graphs, eager tail) against a runner whose tail is
    compiled: median ms of each, the compile + capture time, greedy-code agreement."""
    from omnirelay.engine.interfaces import SamplingParams
    from omnirelay.models.runner import TalkerRow

    compiled, capture_s = _talker_runner(model, config, "inductor")
    out: dict[str, Any] = {"capture_s": capture_s, "num_graphs": len(compiled.graphs)}
    for r in rows:
        compiled.slots.acquire(r.rid)
    compiled.prefill(rows)
    for n in (1, 16, 64):

        def frame(runner: Any, n: int = n) -> torch.Tensor:
            for r in rows[:n]:
                runner.slots.set_length(r.rid, TALKER_ROWS)
            return runner.decode(
                [TalkerRow(r.rid, t, r.sampling, r.generator) for r, t in zip(rows[:n], text)]
            )

        out[f"frame_{n}"] = {
            "plain_ms": median_ms(functools.partial(frame, plain), reps, sync),
            "compiled_ms": median_ms(functools.partial(frame, compiled), reps, sync),
        }
    greedy = [TalkerRow(r.rid, t, SamplingParams(), r.generator) for r, t in zip(rows[:16], text)]
    compiled._codec_embed.copy_(previous)  # the input plain_codes were made from
    for r in rows[:16]:
        compiled.slots.set_length(r.rid, TALKER_ROWS)
    codes = compiled.decode(greedy)
    out["greedy_codes_agreement"] = float((codes == plain_codes).float().mean())
    out["first_codebook_agreement"] = float((codes[:, 0] == plain_codes[:, 0]).float().mean())
    return out


def _code2wav(checkpoint: Any, reps: int, sync: Callable[[], None], compiled: bool) -> dict[str, Any]:
    from omnirelay.models.runner.code2wav import GraphedCode2Wav

    model = checkpoint.load_code2wav()
    graphed = GraphedCode2Wav(model, cuda_graphs=True)
    start = time.monotonic()
    graphed.capture_graphs()
    out: dict[str, Any] = {"capture_s": time.monotonic() - start, "num_graphs": len(graphed.graphs)}
    gen = torch.Generator().manual_seed(0)
    q, size = int(model.config.num_quantizers), int(model.config.codebook_size)
    with torch.inference_mode():
        for b, t in ((1, 4), (1, 29), (1, 50), (16, 50)):
            codes = torch.randint(0, size, (b, q, t), generator=gen)
            out[f"window_{b}x{t}"] = _pair(graphed.graphs, functools.partial(graphed, codes), reps, sync)
    from benchmarks.runner_code2wav import stateful_code2wav, stream_backend

    out["stateful"] = stateful_code2wav(model, reps, sync, stream_backend(model, compiled))
    return out


STAGES = ("thinker", "talker", "code2wav", "tts-code2wav")


def run_runner_bench(
    *,
    device: str = "cuda:0",
    reps: int = 20,
    stream: Any = None,
    stages: tuple[str, ...] = STAGES,
    tiny: bool = False,
    sizes: tuple[int, ...] = (1, 16, 64),
    code2wav_compiled: bool = True,
) -> dict[str, Any]:
    """Time ``stages`` (see the module docstring) on ``device``; the figures as a dict.
    ``sizes``: the rows of the Thinker's and Talker's steps (at most 64).
    ``tiny``: the tiny model instead of the full-size one (the only choice off CUDA,
    where it checks the bench's figures, not a card's). ``code2wav_compiled``: time
    Code2Wav's stream steps compiled too (on CUDA)."""
    from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint

    err = stream if stream is not None else sys.stderr
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise ValueError(f"bench runner needs a CUDA device, got {device!r}")
    if not on_cuda and not tiny:
        raise ValueError(f"bench runner needs a CUDA device for the full-size model, got {device!r}")
    args = ModelArgs(tiny=True, device=device) if tiny else ModelArgs(load_format="dummy", device=device)
    checkpoint = open_checkpoint(args)

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize(device)

    bandwidth = copy_bandwidth(torch.device(device))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__,
        "reps": reps,
        "bandwidth_bytes_per_s": bandwidth,
        "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SWITCHES)},
    }
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    for name in (s for s in STAGES if s in stages):
        err.write(f"bench runner: {name}\n")
        err.flush()
        if name == "thinker":
            report[name] = _thinker(checkpoint, reps, sync, bandwidth, sizes)
        elif name == "talker":
            report[name] = _talker(checkpoint, reps, sync, bandwidth, sizes)
        elif name == "code2wav":
            report[name] = _code2wav(checkpoint, reps, sync, code2wav_compiled)
        else:
            from benchmarks.runner_code2wav import tts_code2wav

            report[name] = tts_code2wav(device, tiny, reps, sync, code2wav_compiled)
    return report


def render_runner_bench(report: dict[str, Any]) -> str:
    lines = [
        f"omnirelay bench runner: {report['device']}, torch {report['torch']}, median of {report['reps']}\n"
    ]
    lines.append(
        f"bandwidth {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (a device copy, read + write); floor: the "
        "step's bytes ÷ that\n"
    )
    switches = report.get("switches") or {}
    lines.append(f"switches: {', '.join(f'{k}={v}' for k, v in switches.items()) or 'none set'}\n")
    lines.append(
        f"{'stage':<10}{'step':<18}{'eager ms':>10}{'graph ms':>10}{'speedup':>9}"
        f"{'MB read':>10}{'floor ms':>10}{'÷ floor':>9}{'kernels':>9}{'experts':>9}  paths (calls)\n"
    )
    for stage in (s for s in STAGES if s in report):
        figures = report[stage]
        for key, value in figures.items():
            if isinstance(value, dict) and "eager_ms" in value:
                line = f"{stage:<10}{key:<18}{value['eager_ms']:>10.2f}{value['graph_ms']:>10.2f}{value['speedup']:>8.1f}x"
                if "floor_ms" in value:
                    line += (
                        f"{value['bytes'] / 1e6:>10.1f}{value['floor_ms']:>10.3f}{value['ratio']:>8.1f}x"
                        f"{value['kernels_per_step']:>9.0f}{value.get('experts_per_layer', 0.0):>9.1f}"
                    )
                if isinstance(value.get("experts"), dict):  # the experts paths that ran, calls each
                    line += "  " + (", ".join(f"{k} {n}" for k, n in value["experts"].items()) or "no MoE")
                lines.append(line + "\n")
        extra = ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in figures.items()
            if not isinstance(v, dict)
        )
        lines.append(f"{stage:<10}{extra}\n")
    for stage in ("code2wav", "tts-code2wav"):
        stateful = report.get(stage, {}).get("stateful")
        if stateful:
            from benchmarks.runner_code2wav import render_stateful

            lines.append(render_stateful(stage, stateful))
    compiled = report.get("talker", {}).get("compiled")
    if compiled:
        lines.append("talker frame, graphs: eager tail vs compiled tail (ms)\n")
        for key, value in compiled.items():
            if isinstance(value, dict):
                speedup = value["plain_ms"] / value["compiled_ms"] if value["compiled_ms"] > 0 else 0.0
                lines.append(
                    f"{'talker':<10}{key:<18}{value['plain_ms']:>10.2f}{value['compiled_ms']:>10.2f}{speedup:>8.1f}x\n"
                )
        lines.append(
            f"{'talker':<10}compile + capture {compiled['capture_s']:.1f} s, greedy codes agree "
            f"{compiled['greedy_codes_agreement']:.1%} (first codebook {compiled['first_codebook_agreement']:.1%})\n"
        )
    return "".join(lines)
