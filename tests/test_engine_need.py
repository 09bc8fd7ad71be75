"""Choosing a step's requests by need (omnirelay.engine.need) in the schedulers, with a
fake clock: a new stream's first chunk (or a new request's first frame) goes in a short
step of its own, not behind a batch of streams with audio banked; a stream left out
grows short of headroom and joins again; no request is lost and the books end empty."""

from __future__ import annotations

import pytest

from omnirelay.engine.need import NeedPolicy, audio_seconds
from omnirelay.models.testing.toy import CountingLM, SampleGenerator
from omnirelay.transfer import TransferEvents
from tests.test_engine_scheduler import Clock, _ar, _gen, _req, assert_empty, gen_chunk, tick


def test_the_policy_says_who_is_urgent() -> None:
    need = NeedPolicy(headroom_s=0.5, seconds_per_token=0.08)
    fresh, ahead, behind = _req(0), _req(1), _req(2)
    ahead.first_token_time = behind.first_token_time = 100.0
    ahead.output_token_ids = [7] * 20  # 1.6 s made at 100.0
    behind.output_token_ids = [7] * 5  # 0.4 s
    assert need.headroom(fresh, 101.0) is None
    assert need.headroom(ahead, 101.0) == pytest.approx(0.6)
    assert [need.is_urgent(r, 101.0) for r in (fresh, ahead, behind)] == [True, False, True]
    assert need.select([ahead, fresh, behind], 101.0) == ([fresh, behind], True)
    assert need.select([ahead], 101.0) == ([ahead], False)  # none urgent: all of them
    assert need.select([fresh, behind], 101.0) == ([fresh, behind], True)  # all urgent: all
    by_audio = NeedPolicy(headroom_s=0.0)
    ahead.output_seconds = 3.0
    assert by_audio.headroom(ahead, 101.0) == pytest.approx(2.0)
    assert audio_seconds([0.0] * 12, 24) == 0.5 and audio_seconds(None, 24) == 0.0
    for bad in ({"headroom_s": -1.0}, {"headroom_s": 0.0, "seconds_per_token": 0.0}):
        with pytest.raises(ValueError):
            NeedPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_step_tokens"):
        NeedPolicy(headroom_s=0.0, max_step_tokens=0)


def test_a_first_chunk_is_decoded_alone_and_the_banked_streams_right_after() -> None:
    clock = Clock()
    # One code makes a second of audio: the old streams bank seconds with their first chunk.
    sched, synth = _gen(clock=clock, need=NeedPolicy(headroom_s=0.0)), SampleGenerator(sample_rate=4)
    old = [_req(i, [0], stage=2, is_placeholder=True) for i in range(4)]
    for r in old:
        sched.add_request(r)
    tick(sched, synth)
    out, _ = tick(sched, synth, TransferEvents(ready=tuple(gen_chunk(r.internal_id, [1, 2]) for r in old)))
    assert out.num_items == 4 and all(r.output_seconds == 2.0 for r in old)
    clock.now += 0.5  # 1.5 s of each old stream left to play
    new = _req("new", [0], stage=2, is_placeholder=True)
    sched.add_request(new)
    tick(sched, synth)
    ready = (*(gen_chunk(r.internal_id, [3], n=1) for r in old), gen_chunk(new.internal_id, [5]))
    out, _ = tick(sched, synth, TransferEvents(ready=ready))
    assert [item.internal_id for item in out.batches[0]] == [new.internal_id]  # alone, first
    out, _ = tick(sched, synth)
    assert sorted(item.internal_id for item in out.batches[0]) == sorted(r.internal_id for r in old)
    ends = tuple(gen_chunk(r.internal_id, [], finished=True, n=2) for r in old)
    tick(sched, synth, TransferEvents(ready=(*ends, gen_chunk(new.internal_id, [], finished=True, n=1))))
    assert_empty(sched)


def test_a_stream_that_ran_dry_is_stepped_with_the_first_chunks() -> None:
    clock = Clock()
    sched, synth = _gen(clock=clock, need=NeedPolicy(headroom_s=0.0)), SampleGenerator(sample_rate=4)
    dry, banked = (
        _req("dry", [0], stage=2, is_placeholder=True),
        _req("banked", [0], stage=2, is_placeholder=True),
    )
    for r in (dry, banked):
        sched.add_request(r)
    tick(sched, synth)
    tick(
        sched,
        synth,
        TransferEvents(ready=(gen_chunk(dry.internal_id, [1]), gen_chunk(banked.internal_id, [1] * 8))),
    )
    clock.now += 1.5  # dry: 1 s made, ran out 0.5 s ago; banked: 8 s made
    new = _req("new", [0], stage=2, is_placeholder=True)
    sched.add_request(new)
    tick(sched, synth)
    ready = (
        gen_chunk(dry.internal_id, [2], n=1),
        gen_chunk(banked.internal_id, [2], n=1),
        gen_chunk(new.internal_id, [3]),
    )
    out, _ = tick(sched, synth, TransferEvents(ready=ready))
    assert {item.internal_id for item in out.batches[0]} == {dry.internal_id, new.internal_id}
    out, _ = tick(sched, synth)
    assert [item.internal_id for item in out.batches[0]] == [banked.internal_id]
    for r in (dry, banked, new):
        sched.abort(r.internal_id)
    assert_empty(sched)


def test_without_urgent_streams_a_step_is_capped_and_rotates() -> None:
    sched, synth = _gen(need=NeedPolicy(headroom_s=0.0, max_step_tokens=4)), SampleGenerator(sample_rate=1)
    reqs = [_req(i, [0], stage=2, is_placeholder=True) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    tick(sched, synth)
    tick(
        sched, synth, TransferEvents(ready=tuple(gen_chunk(r.internal_id, [1]) for r in reqs))
    )  # first chunks: all
    out, _ = tick(
        sched, synth, TransferEvents(ready=tuple(gen_chunk(r.internal_id, [2, 2], n=1) for r in reqs))
    )
    assert out.num_items == 2  # 4 ids of work, then the next step
    out, _ = tick(sched, synth)
    assert out.num_items == 1
    for r in reqs:
        sched.abort(r.internal_id)
    assert_empty(sched)


def test_a_new_requests_first_frame_does_not_wait_for_streams_far_ahead() -> None:
    clock = Clock()
    sched, lm = _ar(clock=clock, need=NeedPolicy(headroom_s=0.0, seconds_per_token=0.08)), CountingLM()
    far = [_req(i, [1], max_tokens=100) for i in range(3)]
    for r in far:
        sched.add_request(r)
    for _ in range(20):  # 1.6 s of frames each, made at once
        out, _ = tick(sched, lm)
        assert out.num_items == 3
    new = _req("new", [1], max_tokens=100)
    sched.add_request(new)
    out, _ = tick(sched, lm)
    assert [item.internal_id for item in out.batches[0]] == [new.internal_id]
    out, _ = tick(sched, lm)  # its first frame made, no one is behind: everyone again
    assert out.num_items == 4
    clock.now += 1.62  # the new stream is 1.46 s behind real time, the far ones 0.06 s ahead
    out, _ = tick(sched, lm)
    assert [item.internal_id for item in out.batches[0]] == [new.internal_id]
    # While a request waits for a slot, steps are not split: the slots free sooner.
    full = _ar(clock=clock, max_num_seqs=2, need=NeedPolicy(headroom_s=0.0, seconds_per_token=0.08))
    ahead, fresh, waiting = _req("a", [1], max_tokens=50), _req("b", [1]), _req("c", [1])
    full.add_request(ahead)
    for _ in range(10):
        tick(full, lm)
    full.add_request(fresh)
    full.add_request(waiting)
    out, _ = tick(full, lm)
    assert {item.internal_id for item in out.batches[0]} == {ahead.internal_id, fresh.internal_id}
    for r in (ahead, fresh, waiting):
        full.abort(r.internal_id)
    assert_empty(full)
    for r in (*far, new):
        sched.abort(r.internal_id)
    assert_empty(sched)
