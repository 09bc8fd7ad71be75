"""A replica killed while it holds non-streamed answers: how many of their clients fail.

The scenario of docs/performance.md (stage replicas, failover through the server): the
server over ``qwen3-omni-tiny-replicas`` in this process, ``--requests`` concurrent
non-streamed chat requests with a spoken answer (``["text", "audio"]``, WAV) — or
``/v1/audio/speech`` WAVs with ``--speech`` — with the official ``openai`` client, retries
off. One replica of ``--stage`` (1: the Talker, 2: Code2Wav) is stopped (SIGSTOP) before
they come, so those bound to it are held there for sure; once the Thinker has given every
request its text and the others are as far as they can go, it is SIGKILLed. The pipeline runs in reproducible mode (docs/usage.md), so every answer
must equal an undisturbed run of the same requests byte for byte (text and every audio
sample); the old judge's tolerance (1 LSB, a tenth of the samples) is a column. ``--old-rule`` submits the
requests as streams are (the router counts what the pipeline produced as delivered): the
figure before the buffered delivery rule (docs/protocol.md §2.9).

Run it from the repository root: ``python3 -m benchmarks.failover_whole --help``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai

from omnirelay.api import Pipeline
from omnirelay.pipeline import load_pipeline
from omnirelay.pipeline.reproducible import with_reproducible
from omnirelay.serving import ServerConfig, ServerThread, create_app
from omnirelay.serving import frontend as frontend_module
from omnirelay.serving.media.audio_out import parse_wav

__all__ = ["main"]

MODEL = "qwen3-omni-tiny-replicas"


def _ask(url: str, i: int, speech: bool) -> tuple[str, bytes]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        if speech:
            r = client.audio.speech.create(
                model=MODEL, voice="ethan", input=f"Number {i}, good morning.", response_format="wav"
            )
            return "", parse_wav(r.content)[0].tobytes()
        chat: Any = client.chat.completions
        c = chat.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            modalities=["text", "audio"],
            audio={"voice": "chelsie", "format": "wav"},
            max_tokens=8,
        )
        audio = c.choices[0].message.audio
        return audio.transcript, parse_wav(base64.b64decode(audio.data))[0].tobytes()
    finally:
        client.close()


def _off_fraction(got: bytes, want: bytes) -> float:
    if len(got) != len(want):
        return 1.0
    x = np.frombuffer(got, dtype="<i2").astype(np.int32)
    y = np.frombuffer(want, dtype="<i2").astype(np.int32)
    return float((np.abs(x - y) > 1).mean()) if len(x) else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.old_rule:  # every request submitted as a stream is
        real = frontend_module.Frontend.submit

        def as_stream(self: Any, **kw: Any) -> Any:
            return real(self, **{**kw, "delivery": frontend_module.STREAMED})

        frontend_module.Frontend.submit = as_stream  # type: ignore[method-assign]
    pipe = Pipeline.start(with_reproducible(load_pipeline(MODEL)))
    server = ServerThread(create_app(pipe, ServerConfig(max_concurrency=4 * args.requests))).start()
    url = server.base_url
    n, stage = args.requests, args.stage
    try:
        with ThreadPoolExecutor(n) as pool:
            want = list(pool.map(lambda i: _ask(url, i, args.speech), range(n)))
        victim = 1
        pid = pipe.replica_pids()[(stage, victim)]
        assert pid is not None
        reruns = pipe.health().num_reruns
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(_ask, url, i, args.speech) for i in range(n)]
            while True:
                health = pipe.health(timeout_s=0.2)
                held = next(
                    s.num_requests for s in health.stages if (s.stage_id, s.replica) == (stage, victim)
                )
                thinker = next(s.num_requests for s in health.stages if s.stage_id == 0)
                done = sum(f.done() for f in futures)
                if thinker == 0 and held > 0 and health.num_requests + done == n:
                    break
                if time.monotonic() - t0 > 300:
                    raise RuntimeError("the requests never reached the stopped replica")
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            results: list[Any] = []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as exc:  # the client's view
                    results.append(f"{type(exc).__name__}: {exc}"[:200])
        failed = [r for r in results if isinstance(r, str)]
        answers = [(r, w) for r, w in zip(results, want) if not isinstance(r, str)]
        wrong = [1 for (t, pcm), (wt, wpcm) in answers if t != wt or pcm != wpcm]
        past_old = [1 for (t, pcm), (wt, wpcm) in answers if t != wt or _off_fraction(pcm, wpcm) > 0.1]
        pipe.wait_ready(300)
        leaks = pipe.leaks()
        return {
            "requests": n,
            "kind": "speech" if args.speech else "chat",
            "stage": stage,
            "old_rule": args.old_rule,
            "held_by_the_killed_replica": held,
            "failed": len(failed),
            "failures": failed[:5],
            "answered": len(answers),
            "wrong": len(wrong),
            "wrong_past_the_old_tolerance": len(past_old),
            "reruns": pipe.health().num_reruns - reruns,
            "leaks": leaks,
        }
    finally:
        server.stop()
        report = pipe.shutdown()
        print(
            f"shutdown: {report.num_killed} killed, {report.num_objects_left} objects left", file=sys.stderr
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.failover_whole", description=__doc__)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument(
        "--stage", type=int, choices=(1, 2), default=1, help="1: a Talker replica, 2: a Code2Wav one"
    )
    p.add_argument("--speech", action="store_true", help="/v1/audio/speech WAVs instead of chat")
    p.add_argument("--old-rule", action="store_true", help="submit them as streams (the rule before)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["failed"] == 0 and out["wrong"] == 0 and not out["leaks"] else 1


if __name__ == "__main__":
    sys.exit(main())
