"""Aborts across the host boundary: ``python -m benchmarks.multihost_abort``.

Starts ``qwen3-omni-tiny-2host`` on a local two-node Ray cluster (UCX over TCP; or on the
cluster at ``--address``), takes each prompt's reference audio with one request, then sends
``--requests`` requests (``--concurrency`` at a time), ``--abort-share`` of them aborted at a
random point: after the first text output, after the first audio chunk (chunks have crossed
the Talker -> Code2Wav nixl edge), or after the second. Checks that every request not
aborted returns exactly its prompt's reference audio, that every aborted one ends
``abort`` (or had already finished), and that afterwards no stage holds request state, no
nixl object or notice is left on either host and no shm object other than free pooled
slots; then shuts down and checks the shutdown left nothing. Prints a summary (``--json``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

PROMPTS = ["Hello, who are you?", "What is the capital of France?", "Count to three.", "Say something nice."]
ABORT_POINTS = ("first_text", "first_audio", "second_audio")


def _drive(pipe: Any, prompt: list[int], rid: str, abort_at: str | None) -> dict[str, Any]:
    import torch

    handle = pipe.submit(prompt, modalities=["text", "audio"], request_id=rid)
    audio: list[Any] = []
    n_audio, aborted_sent, last = 0, False, None
    for out in handle:
        last = out
        if out.modality == "audio" and out.audio is not None and out.audio.numel():
            audio.append(out.audio)
            n_audio += 1
        point = {
            "first_text": out.modality == "text",
            "first_audio": n_audio == 1,
            "second_audio": n_audio == 2,
        }
        if abort_at is not None and not aborted_sent and point[abort_at]:
            handle.abort()
            aborted_sent = True
    reason = None if last is None else last.finish_reason
    return {
        "rid": rid,
        "abort_at": abort_at,
        "finish_reason": reason,
        "audio": torch.cat(audio) if audio else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from omnirelay.api import Pipeline
    from omnirelay.connectors.shm import sweep
    from omnirelay.models import encode_chat_prompt, load_tokenizer

    rng = random.Random(args.seed)
    summary: dict[str, Any] = {"requests": args.requests, "abort_share": args.abort_share}
    with ExitStack() as stack:
        if args.address is None:
            import os

            from omnirelay.orchestrator.local_cluster import local_cluster

            os.environ["RAY_ADDRESS"] = stack.enter_context(local_cluster())
        else:
            import os

            os.environ["RAY_ADDRESS"] = args.address
        t0 = time.monotonic()
        pipe = Pipeline.start("qwen3-omni-tiny-2host", startup_timeout_s=600)
        summary["startup_s"] = time.monotonic() - t0
        summary["placement"] = pipe.placement()
        tok = load_tokenizer(tiny=True, seed=0)
        prompts = [encode_chat_prompt(tok, p) for p in PROMPTS]
        try:
            refs = [_drive(pipe, p, f"ref-{i}", None)["audio"] for i, p in enumerate(prompts)]
            plan = [
                (i % len(prompts), rng.choice(ABORT_POINTS) if rng.random() < args.abort_share else None)
                for i in range(args.requests)
            ]
            t1 = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(
                    pool.map(
                        lambda job: _drive(pipe, prompts[job[1][0]], f"r{job[0]}", job[1][1]), enumerate(plan)
                    )
                )
            summary["run_s"] = time.monotonic() - t1
            wrong, aborted, ended_first = [], 0, 0
            for (p, abort_at), res in zip(plan, results):
                if abort_at is None:
                    if res["finish_reason"] not in ("stop", "length") or not torch.equal(
                        res["audio"], refs[p]
                    ):
                        wrong.append(res["rid"])
                elif res["finish_reason"] == "abort":
                    aborted += 1
                elif res["finish_reason"] in ("stop", "length"):
                    ended_first += 1
                else:
                    wrong.append(res["rid"])
            summary.update(
                aborted=aborted, ended_before_abort=ended_first, wrong=wrong,
                correct=sum(1 for p, _ in plan if _ is None) - len(wrong),
            )  # fmt: skip
            summary["leaks_after"] = pipe.leaks()
            summary["shm_objects_after"] = [
                o.name for o in sweep(pipe.namespace).objects if not (o.kind == "slot" and o.state == "free")
            ]
        finally:
            report = pipe.shutdown()
        summary["shutdown"] = {"num_killed": report.num_killed, "num_objects_left": report.num_objects_left}
    summary["ok"] = not summary["wrong"] and not summary["leaks_after"] and not summary["shm_objects_after"]
    summary["ok"] = summary["ok"] and report.num_objects_left == 0 and report.num_killed == 0
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.multihost_abort", description=__doc__.split("\n\n")[1]
    )
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--abort-share", type=float, default=0.2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--address", default=None, help="a running Ray cluster (default: start a local two-node one)"
    )
    p.add_argument("--json", metavar="PATH", default=None)
    args = p.parse_args(argv)
    summary = run(args)
    printable = {k: v for k, v in summary.items() if k != "placement"}
    print(json.dumps(printable, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
