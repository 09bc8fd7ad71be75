"""One spoken answer of the default pipeline, judged: ``python -m benchmarks.voice_answer``.

Runs the real command, ``omnirelay run --prompt P --out answer.wav --json out.json`` (a
fresh process each time, so its startup counts), then

* transcribes ``answer.wav`` with PocketSphinx's free recognizer and reports the word
  error rate of the audio against the answer's own text (numbers spelled out as the
  voice says them);
* reads the run's timeline: first text token, first audio, the Thinker's last token, the
  last output, and the voice's compute for the whole answer — as ratios within the one run
  (first audio / last output, first audio / Thinker done, synthesis time / audio length);
* checks that nothing is left behind: no process of the run, no /dev/shm object of its
  namespace.

``--runs N`` repeats the command; ``--fresh-cache`` gives the first run an empty model
cache (``$OMNIRELAY_CACHE`` in a temporary directory), so the first run's startup includes
preparing the models (first use) and the later runs show a start that reuses them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from omnirelay.connectors.shm import sweep
from omnirelay.models.asr.sphinx import Recognizer, word_error_rate
from omnirelay.models.prepared import CACHE_ENV
from omnirelay.models.text.spoken import spoken_words

__all__ = ["main", "run_once"]

DEFAULT_PROMPT = "What is the capital of France?"


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0, rate


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def run_once(prompt: str, workdir: Path, recognizer: Recognizer, env: dict[str, str]) -> dict[str, Any]:
    """One ``omnirelay run`` in a child process and what it produced."""
    wav, out = workdir / "answer.wav", workdir / "out.json"
    cmd = [sys.executable, "-m", "omnirelay.cli.main", "run", "--prompt", prompt]
    cmd += ["--out", str(wav), "--json", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=1800)
    wall_s = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"omnirelay run failed ({proc.returncode}):\n{stderr}")
    report = json.loads(out.read_text())
    audio, rate = _read_wav(wav)
    heard = recognizer.words(audio, rate)
    said = spoken_words(report["text"])
    compute = report.get("compute_by_stage_s") or {}
    voice_s = compute.get("1")
    leftovers = [o.name for o in sweep().objects if o.namespace.startswith(f"p{proc.pid}x")]
    return {
        "text": report["text"],
        "heard": " ".join(heard),
        "wer": word_error_rate(said, heard),
        "startup_s": report["startup_s"],
        "command_wall_s": wall_s,
        "ttft_s": report["ttft_s"],
        "ttfa_s": report["ttfa_s"],
        "last_text_s": report.get("last_text_s"),
        "total_s": report["total_s"],
        "audio_s": report["audio_s"],
        "num_audio_chunks": len(report["audio_chunks"]),
        "voice_compute_s": voice_s,
        "ratio_first_audio_to_last_output": _ratio(report["ttfa_s"], report["total_s"]),
        "ratio_first_audio_to_thinker_done": _ratio(report["ttfa_s"], report.get("last_text_s")),
        "ratio_synthesis_to_audio": _ratio(voice_s, report["audio_s"]),
        "shutdown": report["shutdown"],
        "leftover_objects": leftovers,
        "progress": [line for line in stderr.splitlines() if "first use" in line],
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def render(runs: list[dict[str, Any]]) -> str:
    lines = []
    for i, r in enumerate(runs):
        lines.append(f"run {i}: {r['text']!r}")
        lines.append(f"  heard: {r['heard']!r}  WER {r['wer']:.1%}")
        for key in (
            "startup_s",
            "command_wall_s",
            "ttft_s",
            "ttfa_s",
            "last_text_s",
            "total_s",
            "audio_s",
            "num_audio_chunks",
            "voice_compute_s",
            "ratio_first_audio_to_last_output",
            "ratio_first_audio_to_thinker_done",
            "ratio_synthesis_to_audio",
        ):
            lines.append(f"  {key:<36}{_fmt(r[key])}")
        clean = not r["leftover_objects"] and r["shutdown"] == {"num_killed": 0, "num_objects_left": 0}
        lines.append(f"  leftovers: {'none' if clean else r['leftover_objects'] or r['shutdown']}")
        if r["progress"]:
            lines.append(f"  first use: {'; '.join(r['progress'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.voice_answer", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--runs", type=int, default=2, help="how many times to run the command (default 2)")
    p.add_argument("--fresh-cache", action="store_true", help="start from an empty model cache (first use)")
    p.add_argument("--json", metavar="PATH", default=None, help="write every run's figures here")
    args = p.parse_args(argv)
    env = dict(os.environ)
    cache = None
    if args.fresh_cache:
        cache = tempfile.mkdtemp(prefix="omnirelay-voice-cache-")
        env[CACHE_ENV] = cache
    recognizer = Recognizer()
    runs = []
    try:
        for _ in range(max(1, args.runs)):
            with tempfile.TemporaryDirectory(prefix="omnirelay-voice-") as tmp:
                runs.append(run_once(args.prompt, Path(tmp), recognizer, env))
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    sys.stdout.write(render(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"prompt": args.prompt, "runs": runs}, indent=1) + "\n")
    clean = all(not r["leftover_objects"] and not r["shutdown"]["num_objects_left"] for r in runs)
    return 0 if clean else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
