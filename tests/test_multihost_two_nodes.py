"""The two-host simulation, reduced: ``qwen3-omni-tiny-2host`` on a local two-node Ray
cluster (hostA, hostB) with UCX forced onto TCP.

One cluster and one placed pipeline for the module. A request's stages run on two
distinct Ray nodes, the Talker -> Code2Wav edge crosses them over nixl, the audio equals
the one-host pipeline's for the same seed, and nothing is left on either side; then the
remote stage's worker is killed mid-stream: its request fails fast naming stage and node,
new requests are refused (503) until it is back, and it serves again. The module ends with
the pipeline and the cluster shut down and no process of either left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from omnirelay.api import Pipeline, RuntimeHooks
from omnirelay.errors import StageUnavailableError
from omnirelay.models.qwen3_omni import encode_chat_prompt, load_tokenizer
from omnirelay.models.qwen3_omni.tiny import CACHE_ENV
from omnirelay.orchestrator.requests import stage_sampling_defaults
from omnirelay.pipeline import load_pipeline
from omnirelay.worker import leak_paths
from tests.orchestrator_audit import audit_stopped, child_pids
from tests.test_e2e_qwen_tiny import not_free_slots
from tests.test_models_support import tiny_cache, tiny_dir

pytest.importorskip("ray")
pytest.importorskip("nixl_cu12")

TALKER, CODE2WAV = 1, 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from omnirelay.orchestrator.local_cluster import local_cluster

    tiny_dir()
    before = set(child_pids())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tiny_cache()))
        mp.setenv("UCX_TLS", "tcp")
        with local_cluster() as address:
            mp.setenv("RAY_ADDRESS", address)
            yield address
    deadline = time.monotonic() + 30
    while set(child_pids()) - before and time.monotonic() < deadline:
        time.sleep(0.1)  # raylets and GCS exit after the cluster's shutdown returned
    assert set(child_pids()) - before == set(), "Ray processes outlived the cluster"


@pytest.fixture(scope="module")
def pipe(cluster: Any) -> Iterator[Pipeline]:
    config = load_pipeline("qwen3-omni-tiny-2host")
    codec = config.connector_spec("codec_shm")
    short_lease = msgspec.structs.replace(codec, extra={**codec.extra, "nixl_lease_s": LEASE_S})
    config = msgspec.structs.replace(config, connectors={**config.connectors, "codec_shm": short_lease})
    p = Pipeline.start(config, startup_timeout_s=300)
    yield p
    audit_stopped(p)


@pytest.fixture(scope="module")
def prompt(cluster: Any) -> list[int]:
    return encode_chat_prompt(load_tokenizer(tiny=True, seed=0), "Hello, who are you?")


#: The nixl lease of the Talker's objects: what a claimed object a lost reader never
#: acknowledged waits before its producer reclaims it (docs/design.md §4).
LEASE_S = 3.0


def _audio(pipe: Pipeline, prompt: list[int], request_id: str) -> torch.Tensor:
    res = pipe.submit(prompt, modalities=["text", "audio"], request_id=request_id).result(120)
    assert res.finish_reason in ("stop", "length") and res.audio is not None and res.audio.numel() > 0
    return res.audio


def stage_state(pipe: Pipeline) -> dict[int, list[str]]:
    return {sid: leak_paths(state) for sid, state in pipe.leak_state().items() if leak_paths(state)}


def test_stages_on_two_nodes_cross_over_nixl_and_sound_like_one_host(
    pipe: Pipeline, prompt: list[int]
) -> None:
    placed = pipe.placement()
    nodes = {sid: info["node_id"] for sid, info in placed["stages"].items()}
    assert nodes[0] == nodes[TALKER] != nodes[CODE2WAV]
    assert placed["edges"] == {"0 -> 1": "shm", "1 -> 2": "nixl"}
    audio = _audio(pipe, prompt, "two-hosts")
    assert stage_state(pipe) == {}  # no request state, no nixl object or notice, on both sides
    assert not_free_slots(pipe.namespace) == []
    single = Pipeline.start("qwen3-omni-tiny", startup_timeout_s=300)
    try:
        reference = _audio(single, prompt, "one-host")
    finally:
        audit_stopped(single)
    # The same audio up to float rounding: chunks are cut where each run's timing says.
    assert audio.shape == reference.shape and float((audio - reference).abs().max()) < 1e-5


def test_a_killed_remote_stage_fails_its_requests_fast_and_is_refused_until_back(
    pipe: Pipeline, prompt: list[int]
) -> None:
    talker = msgspec.structs.replace(stage_sampling_defaults(pipe.config.stage(TALKER)), max_tokens=400)
    handle = pipe.submit(prompt, modalities=["text", "audio"], sampling={TALKER: talker}, request_id="cut")
    next(o for o in handle if o.modality == "audio" and o.audio is not None and o.audio.numel())
    t0 = time.monotonic()
    os.kill(pipe.pids()[CODE2WAV] or 0, signal.SIGKILL)
    with pytest.raises(StageUnavailableError) as err:
        handle.result(timeout=5.0)
    assert time.monotonic() - t0 < 5.0
    node = pipe.placement()["stages"][CODE2WAV]["node_ip"]
    assert "stage 2 (code2wav)" in str(err.value) and f"on node {node}" in str(err.value)
    with pytest.raises(StageUnavailableError):  # the server's 503, until the stage is back
        pipe.submit(prompt, modalities=["text", "audio"]).result(5)
    pipe.wait_ready(300)
    assert pipe.health().stages[CODE2WAV].num_restarts == 1
    assert _audio(pipe, prompt, "cut").numel() > 0  # the failed id is free again
    assert stage_state(pipe) == {}
    assert not_free_slots(pipe.namespace) == []


def test_replicas_placed_one_per_host_share_the_load_over_nixl(cluster: Any) -> None:
    from benchmarks.replicas import TOY_FACTORY, Load, closed_loop, toy_config

    load = Load(step_s=0.02, batch=2, tokens=4, requests=12, concurrency=6)
    p = Pipeline.start(
        toy_config(2, load, hosts=("hostA", "hostB")),
        runtime=RuntimeHooks(engine_factory=TOY_FACTORY),
        startup_timeout_s=300,
    )
    try:
        placed = p.placement()
        workers = placed["stages"]  # by worker: counter, relay replica 0, relay replica 1, synth
        assert [(w["stage"], w["replica"]) for _, w in sorted(workers.items())] == [
            (0, 0),
            (1, 0),
            (1, 1),
            (2, 0),
        ]
        assert (
            workers[0]["node_id"] == workers[1]["node_id"] == workers[3]["node_id"] != workers[2]["node_id"]
        )
        assert placed["edges"] == {"0 -> 1": "nixl", "1 -> 2": "nixl"}  # the relay spans two hosts
        outcomes, _ = closed_loop(p, load)
        assert all(o.ok and o.exact for o in outcomes), [o for o in outcomes if not o.exact]
        given = {
            s.replica: (s.engine or {}).get("num_added", 0) for s in p.health().stages if s.stage_id == 1
        }
        assert min(given.values()) > 0, given
        assert stage_state(p) == {}
    finally:
        audit_stopped(p)


def test_a_lost_host_fails_its_stages_requests_at_once_and_refuses_new_ones(
    cluster: Any, pipe: Pipeline, prompt: list[int]
) -> None:
    """Last in the module: hostB goes down as a crash would (its raylet and every process)."""
    talker = msgspec.structs.replace(stage_sampling_defaults(pipe.config.stage(TALKER)), max_tokens=400)
    handle = pipe.submit(prompt, modalities=["text", "audio"], sampling={TALKER: talker})
    next(o for o in handle if o.modality == "audio" and o.audio is not None and o.audio.numel())
    t0 = time.monotonic()
    cluster.remove_host("hostB")
    with pytest.raises(StageUnavailableError, match=r"stage 2 \(code2wav\).*on node .*lost") as err:
        handle.result(timeout=5.0)
    assert time.monotonic() - t0 < 5.0, err.value
    with pytest.raises(StageUnavailableError, match="stage 2 \\(code2wav\\)"):
        pipe.submit(prompt, modalities=["text", "audio"]).result(5)
    # The surviving host holds nothing of the failed request: its unclaimed objects went
    # with the release at once; one the lost reader had claimed and never acknowledged
    # goes when its lease runs out, so wait for that (bounded by the lease), no longer.
    deadline = time.monotonic() + LEASE_S + 5.0
    while (left := stage_state(pipe)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == {}
