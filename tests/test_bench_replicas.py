"""The replicas benchmark, reduced (``python -m benchmarks.replicas`` runs it in full).

Scaling: with the relay stage made the bottleneck (a fixed step whatever its batch), two
replicas serve clearly more requests a second than one, every answer exact. Failover: one
relay replica SIGKILLed while requests run; no request fails without having delivered
something (those run again on the other replica), every completed answer is exact and
whole, and nothing is left behind.
"""

from __future__ import annotations

from benchmarks.replicas import Load, failover, scaling


def test_two_replicas_of_the_bottleneck_serve_more_than_one() -> None:
    load = Load(step_s=0.04, batch=4, tokens=4, requests=32, concurrency=16)
    one, two = scaling(load, [1, 2])
    for r in (one, two):
        assert r.completed == r.requests and r.wrong == 0 and not r.leaks, r
    assert set(two.per_replica) == {"relay[0]", "relay[1]"} and min(two.per_replica.values()) > 0
    # The full run's targets are 1.8x (2) and 3x (4); a loaded test box keeps a margin.
    assert two.requests_per_s >= 1.4 * one.requests_per_s, (one.requests_per_s, two.requests_per_s)


def test_a_killed_replica_fails_no_request_that_delivered_nothing() -> None:
    load = Load(step_s=0.04, batch=2, tokens=4, requests=40, concurrency=8)
    r = failover(load, replicas=2, kill_after=10)
    assert r.failed_silent == 0, r
    assert r.wrong == 0 and r.completed + r.failed_streaming == r.requests, r
    assert all(t < 2.0 for t in r.fail_fast_s), r.fail_fast_s
    assert not r.leaks, r.leaks
