"""Reduced runs of the supervision benchmarks (the full ones: ``python -m benchmarks.soak``
and ``python -m benchmarks.supervise``; their output is in docs/performance.md).

* the soak: chunk transfers through ``toy-3stage`` with cancellations, reused ids and a
  stage SIGKILLed and restarted mid-way → every completed request exact, every other one a
  prefix (nothing delivered twice), nothing left;
* the supervise bench against a live server whose stage 0 stalls long requests (so each
  stream is surely mid-way at the kill): streams end with ``stage_unavailable`` within 2 s,
  probes get 503 with ``Retry-After`` until the stage is back, nothing left.
"""

from __future__ import annotations

import asyncio

from benchmarks import soak, supervise
from omnirelay.api import Pipeline, RestartPolicy, RuntimeHooks
from omnirelay.serving import ServerConfig, ServerThread, create_app
from tests.orchestrator_audit import audit_running, audit_stopped
from tests.supervision_fakes import STALL_TOKENS
from tests.test_orchestrator_process import fake_config


def test_reduced_soak_with_a_kill_leaves_nothing_and_delivers_nothing_twice() -> None:
    args = soak.parse_args(["--transfers", "400", "--kill-every", "200", "--concurrency", "8", "--seed", "3"])
    result = soak.run_soak(args)
    assert soak.failures(result, args) == []
    assert len(result["kills"]) == 1 and result["failed_by_kill"] + result["refused_while_down"] > 0
    assert result["reused_ids"] > 0 and result["aborted"] > 0


def test_reduced_supervise_bench_against_a_live_server() -> None:
    policy = RestartPolicy(max_restarts=5, backoff_s=0.05, max_backoff_s=0.2)
    pipe = Pipeline.start(
        fake_config(),
        runtime=RuntimeHooks(engine_factory="tests.supervision_fakes:build_held_engine"),
        restart=policy,
    )
    try:
        app = create_app(pipe, ServerConfig(max_tokens_limit=STALL_TOKENS))
        with ServerThread(app, host="127.0.0.1", port=0) as server:
            args = supervise.parse_args(
                ["--streams", "2", "--stages", "1", "--max-tokens", str(STALL_TOKENS), "--probe-tokens", "3"]
            )
            result = asyncio.run(supervise.supervise(server.base_url, args))
        assert supervise.check(result) == [], supervise.render(result)
        (kill,) = result["kills"]
        assert kill["stream_error_codes"] == ["stage_unavailable"] * 2 and kill["fail_s_max"] < 2.0
        assert kill["restart_s"] > 0 and kill["last_down_s"] is not None
        # The stage was still down when the last such poll was sent: nothing succeeded before.
        assert kill["first_success_s"] >= kill["last_down_s"]
        audit_running(pipe)
    finally:
        audit_stopped(pipe)
