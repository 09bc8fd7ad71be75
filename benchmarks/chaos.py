"""Chaos run through ``omnirelay serve``: replicas SIGKILLed under a mixed load, and what
the clients saw.

The script starts ``omnirelay serve`` on a pipeline with stage replicas
(``qwen3-omni-tiny-replicas`` by default) in reproducible mode (``reproducible: true``,
docs/usage.md: an answer does not depend on what runs beside it, so each can be judged
sample for sample) on a free loopback port and drives it with the
official ``openai`` client, retries off (a retry would hide an error), for a bounded time
(``--duration-s``) or number of requests (``--max-requests``), ``--concurrency`` clients
at a time. The requests cycle through five kinds, each over ``--prompts`` prompts:

* ``chat`` — non-streamed chat with a spoken answer (``["text", "audio"]``, WAV);
* ``chat_text`` — non-streamed chat, text only;
* ``chat_stream`` — streamed chat with a spoken answer (``pcm16`` deltas);
* ``speech`` — ``/v1/audio/speech``, a WAV (sent whole);
* ``speech_stream`` — ``/v1/audio/speech``, ``pcm`` (streamed as it is made).

Before the chaos every (kind, prompt) is asked once, undisturbed: its answer is the
reference. Then every ``--kill-every-s`` seconds (a random interval in that range) a
random replica of a replicated stage is SIGKILLed, once ``/health`` says every worker is
up again. The report (docs/protocol.md §2.9 is the rule it checks):

* **errors, client had nothing** — a request that failed before its client received any
  of the answer (every failure of a non-streamed one): target 0;
* **errors, past the rerun bound** — a request that lost a replica more than 3 times
  (``MAX_RERUNS``) fails by design: counted apart;
* **errors, stream playing** — a stream cut or failed after part of the answer arrived
  (the rule: failed fast, never resumed elsewhere);
* **wrong / duplicated** — an answer that came back whole but is not the reference byte
  for byte (its text, or any audio sample), or a cut stream whose part is not exactly the
  reference's start: target 0. Duplicated: longer than the reference, or where it first
  differs it repeats audio it had already sent. The old judge's tolerance (1 LSB, a tenth
  of the samples) is kept as a column: ``wrong_within_old_tolerance`` counts the wrong
  answers it would have passed;
* **hung** — a request with no answer within ``--request-timeout-s``: target 0;
* kills, the workers' restarts and the pipeline's reruns; and the leaks: ``/health?audit=1``
  once idle, a traceback in the server's log, and (after SIGTERM) any ``omnirelay-*``
  object of the namespace left in /dev/shm.

:func:`run_chaos` drives an already running server (the suite's short form uses the
test server); :func:`main` starts and stops one. Run it from the repository root:
``python3 -m benchmarks.chaos --help``. Exit status 0 when every target held.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from omnirelay.connectors.shm import sweep
from omnirelay.orchestrator.router import MAX_RERUNS, RERUN_BOUND_NOTE
from omnirelay.serving.media.audio_out import parse_wav

__all__ = ["KINDS", "ChaosOptions", "main", "render_chaos", "run_chaos"]

DEFAULT_PIPELINE = "qwen3-omni-tiny-replicas"
KINDS = ("chat", "chat_text", "chat_stream", "speech", "speech_stream")
#: the kinds whose client gets the answer whole (it has nothing until the end)
WHOLE_KINDS = frozenset({"chat", "chat_text", "speech"})


@dataclass(frozen=True)
class ChaosOptions:
    duration_s: float = 60.0
    max_requests: int | None = None
    concurrency: int = 8
    kill_every_s: tuple[float, float] = (20.0, 30.0)
    prompts: int = 4
    max_tokens: int = 8
    request_timeout_s: float = 120.0
    seed: int = 0
    #: stop killing after this many (None: no limit)
    max_kills: int | None = None


@dataclass
class Answer:
    """What one client got: text and 16-bit PCM, whether anything arrived, and the end."""

    text: str = ""
    pcm: bytes = b""
    got_any: bool = False
    error: str | None = None


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    errors_nothing_received: int = 0
    #: failed after losing a replica more often than a request is run again
    errors_rerun_bound: int = 0
    errors_playing: int = 0
    wrong: int = 0
    duplicated: int = 0
    hung: int = 0
    #: wrong answers the old judge (1 LSB, a tenth of the samples) would have passed
    wrong_within_old_tolerance: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.ok,
            "errors_nothing_received": self.errors_nothing_received,
            "errors_rerun_bound": self.errors_rerun_bound,
            "errors_playing": self.errors_playing,
            "wrong": self.wrong,
            "duplicated": self.duplicated,
            "hung": self.hung,
            "wrong_within_old_tolerance": self.wrong_within_old_tolerance,
            "by_kind": dict(self.by_kind),
            "error_samples": self.error_samples[:10],
        }


# -------------------------------------------------------------------------- the clients


def _messages(p: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me something about the number {p}."}]


def _speech_input(p: int) -> str:
    return f"Number {p}: good morning, this is a test."


def ask(client: openai.OpenAI, model: str, kind: str, p: int, max_tokens: int) -> Answer:
    """One request of ``kind`` for prompt ``p``; never raises (the error is in the answer)."""
    a = Answer()
    chat: Any = client.chat.completions  # plain dicts for the typed parameters
    try:
        if kind in ("chat", "chat_text"):
            spoken = kind == "chat"
            r = chat.create(
                model=model,
                messages=_messages(p),
                modalities=["text", "audio"] if spoken else ["text"],
                audio={"voice": "chelsie", "format": "wav"} if spoken else openai.NOT_GIVEN,
                max_tokens=max_tokens,
            )
            msg = r.choices[0].message
            if spoken:
                assert msg.audio is not None
                a.text = msg.audio.transcript
                a.pcm = parse_wav(base64.b64decode(msg.audio.data))[0].tobytes()
            else:
                a.text = msg.content or ""
        elif kind == "chat_stream":
            stream = chat.create(
                model=model,
                messages=_messages(p),
                modalities=["text", "audio"],
                audio={"voice": "chelsie", "format": "pcm16"},
                max_tokens=max_tokens,
                stream=True,
            )
            pcm = bytearray()
            for chunk in stream:
                if not chunk.choices:
                    continue
                delta: Any = chunk.choices[0].delta
                audio = getattr(delta, "audio", None) or {}
                part = audio if isinstance(audio, dict) else vars(audio)
                if part.get("transcript"):
                    a.text += part["transcript"]
                    a.got_any = True
                if part.get("data"):
                    pcm += base64.b64decode(part["data"])
                    a.got_any = True
                if delta.content:
                    a.text += delta.content
                    a.got_any = True
            a.pcm = bytes(pcm)
        elif kind == "speech":
            r2 = client.audio.speech.create(
                model=model, voice="ethan", input=_speech_input(p), response_format="wav"
            )
            a.pcm = parse_wav(r2.content)[0].tobytes()
        else:
            with client.audio.speech.with_streaming_response.create(
                model=model, voice="ethan", input=_speech_input(p), response_format="pcm"
            ) as resp:
                pcm = bytearray()
                for data in resp.iter_bytes():
                    if data:
                        pcm += data
                        a.got_any = True
                a.pcm = bytes(pcm)
    except Exception as exc:  # the client's view: any failure is an error of this request
        a.error = f"{type(exc).__name__}: {exc}"[:300]
    if kind in WHOLE_KINDS:
        a.got_any = a.error is None  # the client has the answer only at the end
    return a


#: the old judge's tolerance (before reproducible mode; a column now, not the verdict):
#: at most this share of the samples off by more than 1 LSB
MAX_DIFFERING_FRACTION = 0.1
#: the audio a duplicated piece is recognised by (two codec frames of 24 kHz pcm16)
_PIECE_BYTES = 2 * 1920 * 2


def _within_old_tolerance(got: bytes, want: bytes) -> bool:
    """The old judge: the same length, at most a tenth of the samples off by > 1 LSB."""
    if len(got) != len(want):
        return False
    x = np.frombuffer(got, dtype="<i2").astype(np.int32)
    y = np.frombuffer(want, dtype="<i2").astype(np.int32)
    return x.size == 0 or float((np.abs(x - y) > 1).mean()) <= MAX_DIFFERING_FRACTION


def _first_difference(got: bytes, want: bytes) -> int:
    """The first byte where ``got`` and ``want`` differ (the shorter's length if one is
    the other's start); -1 when they are equal."""
    if got == want:
        return -1
    n = min(len(got), len(want))
    a = np.frombuffer(got[:n], dtype=np.uint8)
    b = np.frombuffer(want[:n], dtype=np.uint8)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n


def repeats_a_piece(got: bytes, want: bytes) -> bool:
    """Whether ``got``, where it first departs from ``want``, plays audio it had already
    sent: a chunk delivered twice (by a rerun, or a stream resumed)."""
    i = _first_difference(got, want)
    if i < 0 or i >= len(got):
        return False
    i -= i % 2
    piece = got[i : i + _PIECE_BYTES]
    # found starting before i: the search ends before the piece's own place
    return len(piece) >= 64 and got.find(piece, 0, i + len(piece) - 1) != -1


def _difference(got: Answer, want: Answer) -> str:
    if got.text != want.text:
        return f"text {got.text[:40]!r} vs {want.text[:40]!r}"
    if len(got.pcm) != len(want.pcm):
        return f"{len(got.pcm)} bytes of audio vs {len(want.pcm)}, first differing sample {_first_difference(got.pcm, want.pcm) // 2}"
    x = np.frombuffer(got.pcm, dtype="<i2").astype(np.int32)
    y = np.frombuffer(want.pcm, dtype="<i2").astype(np.int32)
    d = np.abs(x - y)
    return f"{int((d > 0).sum())} of {len(d)} samples differ, by up to {int(d.max())}, first at {int(np.argmax(d > 0))}"


def judge(tally: Tally, kind: str, got: Answer | None, want: Answer, sample: str) -> None:
    """Count one request's outcome against its reference."""
    with tally.lock:
        tally.requests += 1
        tally.by_kind[kind] += 1
        if got is None:
            tally.hung += 1
            tally.error_samples.append(f"{sample}: hung")
            return
        if got.error is not None and not got.got_any:
            if RERUN_BOUND_NOTE in got.error:
                tally.errors_rerun_bound += 1
            else:
                tally.errors_nothing_received += 1
            tally.error_samples.append(f"{sample}: {got.error}")
            return
        is_cut = got.error is not None or (
            kind == "speech_stream" and len(got.pcm) < len(want.pcm) and got.got_any
        )
        if is_cut:
            # A stream already playing when its replica died: the part it got must be the
            # reference's start (never another answer's samples, never repeated).
            n = len(got.pcm) - len(got.pcm) % 2
            if len(got.pcm) > len(want.pcm) or repeats_a_piece(got.pcm[:n], want.pcm):
                tally.duplicated += 1
                tally.error_samples.append(f"{sample}: a cut stream's part repeats audio")
            elif got.pcm[:n] != want.pcm[:n]:
                tally.wrong += 1
                tally.wrong_within_old_tolerance += _within_old_tolerance(got.pcm[:n], want.pcm[:n])
                tally.error_samples.append(f"{sample}: a cut stream's part is not the answer's start")
            else:
                tally.errors_playing += 1
            return
        if len(got.pcm) > len(want.pcm) or repeats_a_piece(got.pcm, want.pcm):
            tally.duplicated += 1
            tally.error_samples.append(
                f"{sample}: repeats audio ({len(got.pcm)} bytes of audio, {len(want.pcm)} undisturbed)"
            )
        elif got.text != want.text or got.pcm != want.pcm:
            tally.wrong += 1
            tally.wrong_within_old_tolerance += got.text == want.text and _within_old_tolerance(
                got.pcm, want.pcm
            )
            tally.error_samples.append(
                f"{sample}: differs from the undisturbed answer ({_difference(got, want)})"
            )
        else:
            tally.ok += 1


# ---------------------------------------------------------------------------- the killer


def _health(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(url + "/health", timeout=30.0, trust_env=False).json()
    return body


class Killer:
    """SIGKILLs a random replica of a replicated stage every ``every_s`` (a random interval
    in the range), each time once every worker is up again."""

    def __init__(
        self, url: str, every_s: tuple[float, float], rng: random.Random, max_kills: int | None = None
    ) -> None:
        self.url = url
        self.max_kills = max_kills
        self.every_s = every_s
        self.rng = rng
        self.kills: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-killer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.rng.uniform(*self.every_s)):
            if self.max_kills is not None and len(self.kills) >= self.max_kills:
                return
            while not self._stop.is_set():  # the last victim is back (or never was killed)
                health = _health(self.url)
                if health.get("status") == "healthy":
                    break
                self._stop.wait(0.2)
            if self._stop.is_set():
                return
            victims = [s for s in health["stages"] if s["replicas"] > 1 and s["is_alive"] and s["pid"]]
            if not victims:
                return
            v = self.rng.choice(victims)
            try:
                os.kill(int(v["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(
                {"at_s": round(time.monotonic() - t0, 2), "stage": v["name"], "replica": v["replica"]}
            )


# ------------------------------------------------------------------------------ the run


def _settled(url: str, timeout_s: float) -> dict[str, Any]:
    """``/health?audit=1`` once nothing is in flight (polled, with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.get(url + "/health", params={"audit": "1"}, timeout=30.0, trust_env=False)
        body: dict[str, Any] = resp.json()
        audit = body.get("audit") or {}
        idle = audit.get("num_in_flight") == 0 and audit.get("pipeline_requests") == 0
        if (idle and body.get("num_requests") == 0 and body.get("status") == "healthy") or (
            time.monotonic() > deadline
        ):
            return body
        time.sleep(0.2)


def _references(
    client_of: Callable[[], openai.OpenAI], model: str, opts: ChaosOptions
) -> dict[tuple[str, int], Answer]:
    cases = [(kind, p) for kind in KINDS for p in range(opts.prompts)]
    with ThreadPoolExecutor(opts.concurrency) as pool:
        answers = list(pool.map(lambda c: ask(client_of(), model, c[0], c[1], opts.max_tokens), cases))
    bad = [f"{c}: {a.error}" for c, a in zip(cases, answers) if a.error is not None]
    if bad:
        raise RuntimeError("an undisturbed reference request failed: " + "; ".join(bad[:3]))
    return dict(zip(cases, answers))


def run_chaos(url: str, opts: ChaosOptions) -> dict[str, Any]:
    """Drive the server at ``url`` (references first, then the chaos), audit it; the report."""
    rng = random.Random(opts.seed)
    clients: list[openai.OpenAI] = []
    local = threading.local()

    def client_of() -> openai.OpenAI:
        c = getattr(local, "client", None)
        if c is None:
            c = openai.OpenAI(
                base_url=url + "/v1", api_key="unused", max_retries=0, timeout=opts.request_timeout_s
            )
            local.client = c
            clients.append(c)
        return c

    model = _health(url)["model"]
    reruns_before = int(_health(url).get("num_reruns", 0))
    restarts_before = sum(int(s["restarts"]) for s in _health(url)["stages"])
    refs = _references(client_of, model, opts)
    tally = Tally()
    counter = iter(range(10**9))
    counter_lock = threading.Lock()
    t_end = time.monotonic() + opts.duration_s

    def next_index() -> int | None:
        with counter_lock:
            i = next(counter)
        if time.monotonic() >= t_end or (opts.max_requests is not None and i >= opts.max_requests):
            return None
        return i

    def client_loop() -> None:
        with ThreadPoolExecutor(1) as one:
            while (i := next_index()) is not None:
                kind, p = KINDS[i % len(KINDS)], (i // len(KINDS)) % opts.prompts
                fut = one.submit(ask, client_of(), model, kind, p, opts.max_tokens)
                try:
                    got: Answer | None = fut.result(opts.request_timeout_s + 30.0)
                except TimeoutError:
                    got = None
                judge(tally, kind, got, refs[(kind, p)], f"#{i} {kind}/{p}")
                if got is None:
                    return  # its thread is stuck in the hung request

    killer = Killer(url, opts.kill_every_s, rng, opts.max_kills)
    t0 = time.monotonic()
    killer.start()
    try:
        with ThreadPoolExecutor(opts.concurrency) as pool:
            for f in [pool.submit(client_loop) for _ in range(opts.concurrency)]:
                f.result()
    finally:
        killer.stop()
    wall_s = time.monotonic() - t0
    settled = _settled(url, 120.0)
    for c in clients:
        c.close()
    audit = settled.get("audit") or {}
    return {
        "options": {**opts.__dict__, "kill_every_s": list(opts.kill_every_s)},
        "wall_s": round(wall_s, 1),
        **tally.to_dict(),
        "kills": killer.kills,
        "restarts": sum(int(s["restarts"]) for s in settled["stages"]) - restarts_before,
        "reruns": int(settled.get("num_reruns", 0)) - reruns_before,
        "health_after": settled.get("status"),
        "audit_clean": audit.get("clean") is True,
        "audit": audit,
    }


def targets(report: dict[str, Any]) -> dict[str, bool]:
    """The run's targets (docs/protocol.md §2.9)."""
    checks = {
        "no error for a client that had nothing": report["errors_nothing_received"] == 0,
        "no wrong or duplicated answer": report["wrong"] == 0 and report["duplicated"] == 0,
        "no hung request": report["hung"] == 0,
        "healthy and audit clean afterwards": report["health_after"] == "healthy" and report["audit_clean"],
    }
    if "shm_objects_left" in report:
        checks["nothing left in /dev/shm"] = not report["shm_objects_left"]
        checks["no traceback in the server log"] = report["server_tracebacks"] == 0
    return checks


def render_chaos(report: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(report["by_kind"].items()))
    lines = [
        f"chaos run: {report['requests']} requests in {report['wall_s']} s ({kinds}); "
        f"{len(report['kills'])} kills, {report['restarts']} restarts, {report['reruns']} reruns",
        f"  ok                                  {report['ok']}",
        f"  errors, client had nothing          {report['errors_nothing_received']}",
        f"  errors, past the rerun bound ({MAX_RERUNS})    {report['errors_rerun_bound']}",
        f"  errors, stream already playing      {report['errors_playing']}",
        f"  wrong answers                       {report['wrong']}",
        f"  duplicated audio                    {report['duplicated']}",
        f"  hung                                {report['hung']}",
        f"  wrong, within the old tolerance     {report['wrong_within_old_tolerance']}",
        f"  health afterwards                   {report['health_after']}, audit "
        f"{'clean' if report['audit_clean'] else 'NOT clean'}",
    ]
    if "shm_objects_left" in report:
        lines.append(f"  /dev/shm objects left               {len(report['shm_objects_left'])}")
        lines.append(f"  tracebacks in the server log        {report['server_tracebacks']}")
    for sample in report["error_samples"]:
        lines.append(f"    {sample}")
    for name, ok in targets(report).items():
        lines.append(f"  [{'ok' if ok else 'MISSED'}] {name}")
    return "\n".join(lines) + "\n"


def _range(text: str) -> tuple[float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 0 < parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"expected SECONDS or MIN,MAX with 0 < MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.chaos",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--pipeline", default=DEFAULT_PIPELINE)
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the chaos lasts (default 600)")
    p.add_argument("--max-requests", type=int, default=None, help="stop after this many requests")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--kill-every-s", type=_range, default=(20.0, 30.0), help="MIN,MAX seconds between kills (20,30)"
    )
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts of each kind (default 4)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--json", metavar="PATH", default=None)
    return p


#: the chaos kills far more often than a deployment's restart budget allows, and judges
#: answers byte for byte (reproducible mode, docs/usage.md)
CHAOS_SETTINGS = (
    "restart: {max_restarts: 10000, window_s: 60, backoff_s: 0.2, max_backoff_s: 1}\nreproducible: true\n"
)


def _unexpected_tracebacks(lines: list[str]) -> int:
    """Tracebacks in the server's log but those of a streamed speech body cut by a lost
    replica (the route raises its stage_unavailable to cut the connection: by design)."""
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith("Traceback") or line.startswith("ERROR:"):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    return sum(
        1
        for b in blocks
        if any("Traceback" in x for x in b) and not any("StageUnavailableError" in x for x in b)
    )


def chaos_pipeline(pipeline: str) -> str:
    """A pipeline file of ``pipeline`` whose restart budget never runs out, in reproducible
    mode (its own restart policy and reproducible key, if any, replaced); its path."""
    import omnirelay

    path = Path(pipeline)
    if not path.is_file():
        path = Path(omnirelay.__file__).parent / "pipelines" / f"{pipeline}.yaml"
    lines = path.read_text().splitlines(keepends=True)
    kept, skipping = [], False
    for line in lines:
        if line.startswith(("restart:", "reproducible:")):
            skipping = True
            continue
        if skipping and (line.startswith((" ", "\t")) or not line.strip()):
            continue
        skipping = False
        kept.append(line)
    out = Path(tempfile.mkdtemp(prefix="omnirelay-chaos-")) / path.name
    out.write_text("".join(kept) + "\n" + CHAOS_SETTINGS)
    return str(out)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.load_serve import ServerProcess

    args = build_parser().parse_args(argv)
    if args.concurrency < 1 or args.prompts < 1 or args.duration_s <= 0:
        print("chaos: --concurrency and --prompts must be >= 1, --duration-s > 0", file=sys.stderr)
        return 2
    opts = ChaosOptions(
        duration_s=args.duration_s,
        max_requests=args.max_requests,
        concurrency=args.concurrency,
        kill_every_s=args.kill_every_s,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout_s,
        seed=args.seed,
    )
    server = ServerProcess(chaos_pipeline(args.pipeline), max(64, 4 * args.concurrency))
    server.start(args.startup_timeout_s)
    try:
        report = run_chaos(server.url, opts)
    finally:
        exit_code = server.stop()
    report["pipeline"] = args.pipeline
    report["server_exit"] = exit_code
    report["shm_objects_left"] = [o.name for o in sweep(server.namespace).objects] if server.namespace else []
    report["server_tracebacks"] = _unexpected_tracebacks(server.lines)
    if report["server_tracebacks"]:
        report["server_log_tail"] = server.tail(60)
    sys.stdout.write(render_chaos(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0 if all(targets(report).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
