"""Stage replicas in the router (docs/design.md §11), pure: no processes, no I/O.

The balancer's choice (load, capacity, ties, affinity, health) and the router's bindings:
each request is bound to one replica per stage when it enters the stage, every action for
it goes to that replica, the previous stage announces its chunks there, and a replica's
death reruns what the client has had nothing of and fails what is already playing.

Every router test ends with the router's books empty and every replica's booked load 0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.errors import ConfigError
from omnirelay.orchestrator.replicas import ReplicaBalancer
from omnirelay.orchestrator.requests import PipelineRequest
from omnirelay.orchestrator.router import (
    RERUN_BOUND_NOTE,
    Action,
    ClientOutput,
    Rerun,
    Router,
    StageAbort,
    StageRelease,
)
from omnirelay.pipeline import PipelineConfig, parse_pipeline
from tests.test_orchestrator_router import PROMPT, _stage, of, out, submits


def omni(talkers: int = 2, vocoders: int = 2, **talker: Any) -> PipelineConfig:
    """Thinker (text) -> Talker × ``talkers`` -> Code2Wav × ``vocoders`` (audio), chunk edges."""
    return parse_pipeline(
        {
            "name": "omni-replicas",
            "stages": [
                _stage(0, "thinker", chunk_processor="c0", final_output=True, final_output_type="text"),
                _stage(1, "talker", chunk_processor="c1", replicas=talkers, **talker),
                _stage(
                    2,
                    "code2wav",
                    execution_type="generation",
                    final_output=True,
                    final_output_type="audio",
                    replicas=vocoders,
                ),
            ],
        }
    )


def tts_aligner() -> PipelineConfig:
    """Talker × 2 -> Code2Wav (chunks) -> aligner × 3 (complete input: bound when forwarded)."""
    return parse_pipeline(
        {
            "name": "tts",
            "stages": [
                _stage(0, "talker", chunk_processor="c0", replicas=2),
                _stage(
                    1, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"
                ),
                _stage(
                    2,
                    "aligner",
                    execution_type="generation",
                    async_chunk=False,
                    input_builder="code2wav_to_aligner",
                    final_output=True,
                    final_output_type="timestamps",
                    replicas=3,
                ),
            ],
        }
    )


def req(rid: str, modalities: tuple[str, ...] | None = ("audio",), **kw: Any) -> PipelineRequest:
    kw.setdefault("prompt_token_ids", list(PROMPT))
    return PipelineRequest(request_id=rid, modalities=modalities, **kw)


def assert_idle(r: Router) -> None:
    assert r.num_requests == 0
    assert all(load.num_requests == 0 for load in r.balancer.describe()), r.balancer.describe()


def finish(r: Router, rid: str, replica_of: dict[int, int]) -> list[Action]:
    """Every stage of the omni pipeline finishes ``rid`` (outputs from its bound replicas)."""
    acts: list[Action] = []
    acts += r.on_output(out(rid, 0, finished=True, token_ids=[1], finish_reason="stop"), replica_of[0])
    acts += r.on_output(out(rid, 1, finished=True), replica_of[1])
    acts += r.on_output(out(rid, 2, finished=True, audio=torch.ones(2), finish_reason="stop"), replica_of[2])
    return acts


# ------------------------------------------------------------------------------ balancer


def test_the_least_loaded_replica_wins_and_ties_go_round_robin() -> None:
    b = ReplicaBalancer({0: 3})
    picks = []
    for _ in range(6):
        r = b.choose(0)
        assert r is not None
        b.bind(0, r)
        picks.append(r)
    assert picks == [0, 1, 2, 0, 1, 2]
    b.unbind(0, 1)
    b.unbind(0, 1)
    assert b.choose(0) == 1  # the one that finished its work
    assert [b.load(0, r) for r in range(3)] == [2, 0, 2]


def test_load_is_weighed_by_each_replicas_reported_capacity() -> None:
    b = ReplicaBalancer({0: 2}, capacity={0: 4})
    b.set_capacity(0, 1, 12)  # replica 1 reports three times the slots
    picks = []
    for _ in range(8):
        r = b.choose(0)
        assert r is not None
        b.bind(0, r)
        picks.append(r)
    assert picks.count(1) == 6 and picks.count(0) == 2  # 2/4 == 6/12
    assert b.describe()[1].capacity == 12


def test_a_session_returns_to_its_replica_until_it_is_much_busier() -> None:
    b = ReplicaBalancer({0: 2}, affinity_slack=2)
    first = b.choose(0, "conv-1")
    assert first is not None
    b.bind(0, first)
    b.bind(0, first)  # two more requests there
    assert b.choose(0, "conv-1") == first  # 2 more than the other: within the slack
    b.bind(0, first)
    other = b.choose(0, "conv-1")
    assert other is not None and other != first  # 3 more: the session moves …
    assert b.choose(0, "conv-1") == other  # … and is remembered where it went
    assert b.choose(0, None) in (0, 1)


def test_a_down_replica_is_avoided_and_used_again_once_back() -> None:
    b = ReplicaBalancer({0: 2})
    b.mark_down(0, 0)
    assert [b.choose(0) for _ in range(3)] == [1, 1, 1]
    b.mark_down(0, 1)
    assert b.choose(0) is None and not b.has_up(0)
    b.mark_up(0, 0)
    assert b.choose(0) == 0
    b.mark_up(0, 1)
    b.bind(0, 0)
    assert b.choose(0) == 1  # back, and the least loaded


def test_a_session_whose_replica_is_down_goes_elsewhere() -> None:
    b = ReplicaBalancer({0: 2})
    assert b.choose(0, "s") == 0
    b.mark_down(0, 0)
    assert b.choose(0, "s") == 1


def test_unbinding_more_than_bound_is_a_bug_not_a_negative_load() -> None:
    b = ReplicaBalancer({0: 2})
    with pytest.raises(RuntimeError, match="unbound more often"):
        b.unbind(0, 0)


# ------------------------------------------------------------------------------ router


def test_admission_binds_the_entry_and_prewarmed_stages_and_wires_each_edge() -> None:
    r = Router(omni())
    acts = r.admit(req("a"))
    subs = submits(acts)
    assert sorted(subs) == [0, 1, 2]
    bound = r.binding("a")
    assert {s: sub.replica for s, sub in subs.items()} == bound
    # each stage's request names the next stage's replica: its chunks are announced there
    assert subs[0].request.send_to_replica == bound[1]
    assert subs[1].request.send_to_replica == bound[2]
    assert subs[2].request.send_to_replica == 0
    acts2 = r.admit(req("b"))
    assert r.binding("b")[1] != bound[1] and r.binding("b")[2] != bound[2]  # spread
    assert [r.num_requests_on(1, k) for k in (0, 1)] == [1, 1]
    for rid, a in (("a", acts), ("b", acts2)):
        end = finish(r, rid, r.binding(rid))
        assert of(end, ClientOutput)[-1].output.finished
        rel = of(end, StageRelease)
        assert {(x.stage_id, x.replica) for x in rel} == set(r_bind(a).items())
    assert_idle(r)


def r_bind(actions: list[Action]) -> dict[int, int]:
    return {s: sub.replica for s, sub in submits(actions).items()}


def test_a_forwarded_stage_is_bound_when_its_input_is_forwarded() -> None:
    r = Router(tts_aligner(), input_builders={2: lambda src, request, stage: _forwarded()})
    acts = r.admit(req("a", modalities=("audio", "timestamps")))
    assert sorted(submits(acts)) == [0, 1]  # the aligner is not prewarmed: no binding yet
    assert 2 not in r.binding("a")
    talker = r.binding("a")[0]
    r.on_output(out("a", 0, finished=True), talker)
    acts = r.on_output(out("a", 1, finished=True, audio=torch.ones(3), finish_reason="stop"), 0)
    sub = submits(acts)[2]
    assert sub.replica == r.binding("a")[2]
    acts = r.on_output(out("a", 2, finished=True, finish_reason="stop"), sub.replica)
    assert of(acts, ClientOutput)[-1].output.finished
    releases = {(x.stage_id, x.replica) for x in of(acts, StageRelease)}
    assert releases == {(0, talker), (1, 0), (2, sub.replica)}
    assert_idle(r)


def _forwarded() -> Any:
    from omnirelay.orchestrator.requests import ForwardedInput

    return ForwardedInput(prompt_token_ids=[1, 2])


def test_an_output_from_a_replica_the_request_is_not_bound_to_is_dropped() -> None:
    r = Router(omni())
    r.admit(req("a"))
    bound = r.binding("a")
    stale = r.on_output(out("a", 2, audio=torch.ones(4)), 1 - bound[2])
    assert stale == [] and r.num_dropped_outputs == 1
    assert of(r.on_output(out("a", 2, audio=torch.ones(4)), bound[2]), ClientOutput)
    r.abort("a")
    assert_idle(r)


def test_a_dead_replica_reruns_requests_the_client_had_nothing_of() -> None:
    r = Router(omni())
    r.admit(req("quiet"))
    r.admit(req("playing"))
    dead = r.binding("quiet")[1]
    assert r.binding("playing")[1] != dead
    r.admit(req("playing2"))  # the third goes back to `dead`
    assert r.binding("playing2")[1] == dead
    r.on_output(out("playing2", 2, audio=torch.ones(4)), r.binding("playing2")[2])  # heard
    quiet = r.binding("quiet")
    acts = r.on_replica_died(1, dead, "stage 1 (talker) replica 0 died")
    (rerun,) = of(acts, Rerun)
    assert rerun.request.request_id == "quiet" and rerun.num_reruns == 1
    assert "quiet" not in r  # it ended everywhere; the front admits it again once released
    aborted = {(a.stage_id, a.replica) for a in of(acts, StageAbort) if a.request_id == "quiet"}
    assert aborted == set(quiet.items())
    released = {(a.stage_id, a.replica) for a in of(acts, StageRelease) if a.request_id == "quiet"}
    assert released == set(quiet.items())
    (failed,) = [o.output for o in of(acts, ClientOutput)]
    assert failed.request_id == "playing2" and failed.error_code == "stage_unavailable"
    assert failed.retry_after_s == 0.0  # the other replica serves: retry at once
    # the request runs again on the surviving replica, under the same id
    acts = r.admit(rerun.request, num_reruns=rerun.num_reruns)
    assert r.binding("quiet")[1] == 1 - dead
    assert "playing" in r
    for rid in ("quiet", "playing"):
        finish(r, rid, r.binding(rid))
    assert_idle(r)


def test_a_buffered_request_runs_again_whatever_its_consumer_got_and_is_told_to_drop_it() -> None:
    r = Router(omni())
    ta = ("text", "audio")
    for rid in ("whole", "stream", "stream3", "other", "whole2"):  # alternate: A B A B A
        r.admit(req(rid, modalities=ta, buffered=rid.startswith("whole")))
    dead = r.binding("whole")[1]
    assert [r.binding(rid)[1] == dead for rid in ("stream", "stream3", "other", "whole2")] == [
        False,
        True,
        False,
        True,
    ]
    got = []
    for rid in ("whole", "stream3"):  # the Thinker's text and some audio came out of both
        got += r.on_output(out(rid, 0, token_ids=[5], text="hi"), r.binding(rid)[0])
        got += r.on_output(out(rid, 2, audio=torch.ones(4)), r.binding(rid)[2])
    assert {o.request_id for o in of(got, ClientOutput)} == {"whole", "stream3"}
    acts = r.on_replica_died(1, dead, "stage 1 (talker) replica 0 died")
    reruns = {x.request.request_id: x for x in of(acts, Rerun)}
    assert sorted(reruns) == ["whole", "whole2"]
    assert all(x.num_reruns == 1 and x.request.buffered for x in reruns.values())
    told = {o.request_id: o.output for o in of(acts, ClientOutput)}
    # whole got outputs: told to drop them, before its rerun; whole2 got none: nothing to say
    assert told["whole"].restarted and not told["whole"].finished
    assert told["whole"].audio is None and told["whole"].text is None
    assert "whole2" not in told
    assert told["stream3"].error_code == "stage_unavailable"  # a stream already playing fails
    order = [
        type(a).__name__
        for a in acts
        if getattr(a, "request_id", None) == "whole"
        or (isinstance(a, Rerun) and a.request.request_id == "whole")
    ]
    assert order.index("ClientOutput") < order.index("Rerun")
    for rid, rerun in reruns.items():
        r.admit(rerun.request, num_reruns=rerun.num_reruns)
        assert r.binding(rid)[1] == 1 - dead
        end = finish(r, rid, r.binding(rid))
        assert of(end, ClientOutput)[-1].output.finished
    for rid in ("stream", "other"):  # the other replica's go on
        assert of(finish(r, rid, r.binding(rid)), ClientOutput)[-1].output.finished
    assert_idle(r)


def test_a_buffered_request_still_fails_past_the_rerun_bound() -> None:
    r = Router(omni())
    request = req("a", buffered=True)
    r.admit(request, num_reruns=3)
    r.on_output(out("a", 2, audio=torch.ones(4)), r.binding("a")[2])
    acts = r.on_replica_died(1, r.binding("a")[1], "died")
    assert not of(acts, Rerun)
    (failed,) = [o.output for o in of(acts, ClientOutput)]
    assert failed.finished and failed.error_code == "stage_unavailable"
    assert RERUN_BOUND_NOTE in (failed.error or "")  # why a whole answer failed
    assert_idle(r)


def test_reruns_are_bounded() -> None:
    r = Router(omni())
    n = 0
    request = req("a")
    while True:
        r.admit(request, num_reruns=n)
        replica = r.binding("a")[1]
        acts = r.on_replica_died(1, replica, "died")
        r.on_replica_back(1, replica)
        reruns = of(acts, Rerun)
        if not reruns:
            break
        n = reruns[0].num_reruns
    (failed,) = [o.output for o in of(acts, ClientOutput)]
    assert n == 3 and failed.error_code == "stage_unavailable"
    assert_idle(r)


def test_the_last_replica_down_makes_the_stage_unavailable_until_one_is_back() -> None:
    r = Router(omni())
    r.admit(req("a"))
    first = r.binding("a")[1]
    acts = r.on_replica_died(1, first, "replica died")
    assert of(acts, Rerun)
    acts = r.on_replica_died(1, 1 - first, "the other died too", retry_after_s=3.0)
    assert r.dead_stages() == {1: "the other died too"}
    (rejected,) = [o.output for o in of(r.admit(req("b")), ClientOutput)]
    assert rejected.error_code == "stage_unavailable" and rejected.retry_after_s == 3.0
    text_only = r.admit(req("c", modalities=("text",)))  # does not need the Talker
    assert sorted(submits(text_only)) == [0]
    r.on_output(out("c", 0, finished=True, finish_reason="stop"), 0)
    r.on_replica_back(1, 1 - first)
    assert r.dead_stages() == {}
    r.admit(req("d"))
    assert r.binding("d")[1] == 1 - first  # the one back; the other is still down
    r.abort("d")
    assert_idle(r)


def test_a_request_that_no_longer_needs_the_dead_replica_goes_on() -> None:
    r = Router(omni())
    r.admit(req("a"))
    bound = r.binding("a")
    r.on_output(out("a", 0, finished=True, finish_reason="stop"), bound[0])
    r.on_output(out("a", 1, finished=True), bound[1])
    r.on_output(out("a", 2, audio=torch.ones(1)), bound[2])
    # The Talker finished and Code2Wav read its chunks? Not yet finished: it still needs them.
    acts = r.on_replica_died(1, bound[1], "died")
    assert of(acts, ClientOutput)  # delivered already: fails fast
    r.admit(req("b"))
    bound = r.binding("b")
    r.on_output(out("b", 1, finished=True), bound[1])
    r.on_output(out("b", 2, finished=True, audio=torch.ones(1)), bound[2])
    acts = r.on_replica_died(1, 1 - bound[1], "the other died")
    assert acts == [] or not of(acts, Rerun)
    r.abort("b")
    assert_idle(r)


def test_releases_go_only_to_bound_replicas_and_to_single_replica_stages() -> None:
    r = Router(tts_aligner(), input_builders={2: lambda src, request, stage: _forwarded()})
    acts = r.admit(req("a", modalities=("audio",)))  # the aligner is not on its path
    acts = r.abort("a")
    releases = {(x.stage_id, x.replica) for x in of(acts, StageRelease)}
    assert releases == {(0, r_first(acts)), (1, 0)}  # the 3-replica aligner was never bound
    assert_idle(r)


def r_first(actions: list[Action]) -> int:
    (abort,) = [a for a in of(actions, StageAbort) if a.stage_id == 0]
    return int(abort.replica)


# ------------------------------------------------------------------------------ config


def test_per_replica_devices_and_resources_and_the_workers_view() -> None:
    cfg = parse_pipeline(
        {
            "name": "p",
            "placement": {"backend": "ray"},
            "stages": [
                _stage(0, "a", chunk_processor="c0", final_output=True, final_output_type="text"),
                _stage(
                    1,
                    "b",
                    execution_type="generation",
                    final_output=True,
                    final_output_type="audio",
                    replicas=2,
                    devices=["cuda:0", "cuda:1"],
                    resources=[{"hostA": 1}, {"hostB": 1}],
                ),
            ],
        }
    )
    assert [(w.index, w.stage_id, w.replica) for w in cfg.workers()] == [(0, 0, 0), (1, 1, 0), (2, 1, 1)]
    view = cfg.for_replica(1, 1).stages[1]
    assert (view.replica, view.devices, view.resources) == (1, "cuda:1", {"hostB": 1.0})
    assert cfg.stages[1].devices == "cuda:0" and cfg.stages[1].replica_label(1) == "stage 1 (b) replica 1"
    assert cfg.for_replica(0, 0) is cfg
    with pytest.raises(ConfigError, match="no replica 2"):
        cfg.for_replica(1, 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"replicas": 0}, "must be an int in 1..64"),
        ({"replicas": 65}, "must be an int in 1..64"),
        ({"replicas": "2"}, "expected an int"),
        ({"replicas": 2, "devices": ["cpu"]}, "lists 1 entries but the stage has replicas: 2"),
        ({"devices": ["cpu", "cpu"]}, "lists 2 entries but the stage has replicas: 1"),
        ({"replica": 1}, "unknown stage key"),
    ],
)
def test_bad_replica_settings_say_what_to_write(change: dict[str, Any], message: str) -> None:
    stages = [
        _stage(0, "a", chunk_processor="c0", final_output=True, final_output_type="text"),
        _stage(1, "b", execution_type="generation", final_output=True, final_output_type="audio", **change),
    ]
    with pytest.raises(ConfigError, match=message):
        parse_pipeline({"name": "p", "stages": stages})


def test_a_replicated_stage_cannot_use_the_in_process_connector() -> None:
    stages = [
        _stage(0, "a", chunk_processor="c0", final_output=True, final_output_type="text", replicas=2),
        _stage(1, "b", execution_type="generation", final_output=True, final_output_type="audio"),
    ]
    with pytest.raises(ConfigError, match="inproc connector cannot link"):
        parse_pipeline(
            {
                "name": "p",
                "connectors": {"x": {"backend": "inproc"}},
                "default_connector": "x",
                "stages": stages,
            }
        )
