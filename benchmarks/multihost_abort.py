"""Aborts across the host boundary: ``python -m benchmarks.multihost_abort``.

Places ``toy-3stage`` (deterministic: every answer is known exactly) on a local two-node
Ray cluster — counter and relay on ``hostA``, synth on ``hostB``, so the relay -> synth
chunk edge resolves to ``nixl`` over TCP — or on the cluster at ``--address``. Sends
``--requests`` requests (``--concurrency`` at a time), ``--abort-share`` of them aborted at
a random point of their stream (after a random number of outputs, so some after chunks
crossed the boundary); every request not aborted must return exactly its expected text and
waveform, every aborted one must end ``abort`` (or have finished first). Afterwards no
stage may hold request state, no nixl object or notice may be left on either host, no shm
object other than free pooled slots; the shutdown must leave nothing. Prints a summary
(``--json`` writes it). ``--pipeline qwen3-omni-tiny-2host`` runs the tiny Qwen3-Omni
instead (answers checked for completion and audio only: batching changes sampled tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

TOY = "toy-3stage"
QWEN = "qwen3-omni-tiny-2host"


def placed_toy() -> Any:
    """toy-3stage with counter and relay on hostA, synth on hostB."""
    from omnirelay.pipeline import parse_pipeline
    from omnirelay.pipeline.yamlfile import parse_yaml, read_pipeline_text

    source, text = read_pipeline_text(TOY)
    data: Any = parse_yaml(text, source)
    data["placement"] = {"backend": "ray", "address": "auto"}
    for stage, host in zip(data["stages"], ("hostA", "hostA", "hostB")):
        stage["resources"] = {host: 1}
    return parse_pipeline(data, source=source)


def _drive(pipe: Any, job: tuple[str, list[int], int, int | None]) -> dict[str, Any]:
    from omnirelay.engine.interfaces import SamplingParams

    rid, prompt, n, abort_after = job
    sampling = SamplingParams(max_tokens=n) if n else None
    handle = pipe.submit(prompt, modalities=["text", "audio"], sampling=sampling, request_id=rid)
    outs = []
    for out in handle:
        outs.append(out)
        if abort_after is not None and len(outs) == abort_after:
            handle.abort()
    return {"rid": rid, "outs": outs}


def _is_expected(job: tuple[str, list[int], int, int | None], outs: list[Any], toy: bool) -> bool:
    import torch

    if not outs or outs[-1].finish_reason not in ("stop", "length"):
        return False
    pieces = [o.audio.reshape(-1) for o in outs if o.modality == "audio" and o.audio is not None]
    if not toy:
        return bool(pieces) and sum(p.numel() for p in pieces) > 0
    from omnirelay.models.testing.toy import (
        expected_counting_tokens,
        expected_relay_tokens,
        expected_waveform,
    )

    _, prompt, n, _ = job
    text = expected_counting_tokens(prompt, n)
    got = [t for o in outs if o.modality == "text" for t in o.token_ids]
    return (
        got == text
        and bool(pieces)
        and torch.equal(torch.cat(pieces), expected_waveform(expected_relay_tokens(text)))
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omnirelay.api import Pipeline
    from omnirelay.connectors.shm import sweep

    toy = args.pipeline == TOY
    rng = random.Random(args.seed)
    chat: list[int] = []
    if not toy:
        from omnirelay.models.qwen3_omni import encode_chat_prompt, load_tokenizer

        chat = encode_chat_prompt(load_tokenizer(tiny=True, seed=0), "Hello, who are you?")
    plan = []
    for i in range(args.requests):
        n = rng.randint(8, 48) if toy else 0
        abort_after = rng.randint(1, 2 * n if toy else 6) if rng.random() < args.abort_share else None
        prompt = [rng.randint(0, 999)] if toy else chat
        plan.append((f"r{i}", prompt, n, abort_after))
    summary: dict[str, Any] = {
        "pipeline": args.pipeline,
        "requests": args.requests,
        "abort_share": args.abort_share,
    }
    with ExitStack() as stack:
        if args.address is None:
            from omnirelay.orchestrator.local_cluster import local_cluster

            os.environ["RAY_ADDRESS"] = stack.enter_context(local_cluster())
        else:
            os.environ["RAY_ADDRESS"] = args.address
        t0 = time.monotonic()
        pipe = Pipeline.start(placed_toy() if toy else QWEN, startup_timeout_s=600)
        summary["startup_s"] = round(time.monotonic() - t0, 1)
        summary["edges"] = pipe.placement()["edges"]
        try:
            t1 = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda job: _drive(pipe, job), plan))
            summary["run_s"] = round(time.monotonic() - t1, 1)
            wrong, aborted, ended_first, correct = [], 0, 0, 0
            for job, res in zip(plan, results):
                outs = res["outs"]
                if job[3] is not None and outs and outs[-1].finish_reason == "abort":
                    aborted += 1
                elif _is_expected(job, outs, toy):
                    correct += 1
                    ended_first += job[3] is not None
                else:
                    wrong.append(job[0])
            summary.update(
                planned_aborts=sum(1 for j in plan if j[3] is not None), aborted=aborted,
                ended_before_abort=ended_first, correct=correct, wrong=wrong,
            )  # fmt: skip
            summary["leaks_after"] = pipe.leaks()
            summary["shm_objects_after"] = [
                o.name for o in sweep(pipe.namespace).objects if not (o.kind == "slot" and o.state == "free")
            ]
        finally:
            report = pipe.shutdown()
        summary["shutdown"] = {"num_killed": report.num_killed, "num_objects_left": report.num_objects_left}
    summary["ok"] = (
        not summary["wrong"] and not summary["leaks_after"] and not summary["shm_objects_after"]
        and report.num_objects_left == 0 and report.num_killed == 0
    )  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.multihost_abort", description=__doc__.split("\n\n")[1]
    )
    p.add_argument("--pipeline", choices=(TOY, QWEN), default=TOY)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--abort-share", type=float, default=0.2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--address", default=None, help="a running Ray cluster (default: start a local two-node one)"
    )
    p.add_argument("--json", metavar="PATH", default=None)
    args = p.parse_args(argv)
    summary = run(args)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
