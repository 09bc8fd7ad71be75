"""Prometheus metrics of one server: :class:`ServerMetrics` (its own registry, no globals).

Request-side figures are recorded as requests run (:meth:`ServerMetrics.observe_request`
and the counters); pipeline-side figures (per stage: alive, queue depth, pending
transfer objects, live bytes, bytes moved; per edge: pending bytes and keys) are read
from the last :class:`~omnirelay.orchestrator.PipelineHealth` that :meth:`update_health`
was given — ``/metrics`` probes health right before rendering.

==========================================  ==============================================
metric                                      meaning
==========================================  ==============================================
omnirelay_requests_total{endpoint,outcome}  requests by outcome: ok, aborted, failed,
                                            rejected (429), invalid (other 4xx)
omnirelay_aborts_total{reason}              aborts: client_disconnect, stop_sequence,
                                            session_closed
omnirelay_failures_total{endpoint}          requests the pipeline failed
omnirelay_requests_in_flight                admitted requests not yet done
omnirelay_websockets_open{endpoint}         open WebSockets, each holding a connection
                                            slot (``speech_ws``, ``realtime``)
omnirelay_websockets_refused_total          WebSockets refused at ``max_websockets``
{endpoint}
omnirelay_time_to_first_audio_seconds       submit → first audio sample sent
omnirelay_first_playable_audio_seconds      submit → the earliest moment a player could
                                            start and never run dry (per stream, at its end)
omnirelay_audio_underruns_total             gaps a player starting at the first audio
                                            would hear
omnirelay_audio_gap_seconds                 each such gap's length
omnirelay_audio_streams_total{gap_free}     audio streams ended, gap-free (worst gap
                                            ≤ 50 ms) or not
omnirelay_time_to_first_token_seconds       submit → first text token
omnirelay_real_time_factor                  wall time / audio duration (< 1: faster
                                            than real time)
omnirelay_stage_e2e_seconds{stage}          a final stage's own time for a request
omnirelay_stage_up{stage}                   1 when the worker is alive
omnirelay_stage_restarts_total{stage}       times the stage's worker was restarted
omnirelay_stage_queue_depth{stage}          requests the stage's engine holds
omnirelay_stage_pending_objects{stage}      transfer objects sent and not yet reaped
omnirelay_stage_live_bytes{stage}           bytes of live transfer objects
omnirelay_stage_transfer_bytes_total        bytes put / got by the stage's connector
omnirelay_edge_pending_bytes{edge}          unconsumed bytes on an edge (``1->2``)
omnirelay_edge_pending_keys{edge}           unconsumed objects on an edge
==========================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omnirelay.api import PipelineHealth
from omnirelay.timeline.playback import Playback

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0)
#: Gap lengths (seconds): the 50 ms gap-free bound among them.
_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _HealthCollector(Collector):
    """Yields the pipeline-side families from the last health snapshot."""

    def __init__(self) -> None:
        self.snapshot: PipelineHealth | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        up = GaugeMetricFamily("omnirelay_stage_up", "1 when the stage worker is alive", labels=["stage"])
        depth = GaugeMetricFamily(
            "omnirelay_stage_queue_depth", "requests the stage's engine holds", labels=["stage"]
        )
        restarts = CounterMetricFamily(
            "omnirelay_stage_restarts", "times the stage's worker was restarted", labels=["stage"]
        )
        held = GaugeMetricFamily(
            "omnirelay_stage_requests", "requests the stage holds by the router's books", labels=["stage"]
        )
        pending = GaugeMetricFamily(
            "omnirelay_stage_pending_objects", "transfer objects sent and not yet reaped", labels=["stage"]
        )
        live = GaugeMetricFamily(
            "omnirelay_stage_live_bytes", "bytes of live transfer objects", labels=["stage"]
        )
        moved = CounterMetricFamily(
            "omnirelay_stage_transfer_bytes",
            "bytes moved by the stage's connector",
            labels=["stage", "direction"],
        )
        edge_bytes = GaugeMetricFamily(
            "omnirelay_edge_pending_bytes", "unconsumed bytes on an edge", labels=["edge"]
        )
        edge_keys = GaugeMetricFamily(
            "omnirelay_edge_pending_keys", "unconsumed transfer objects on an edge", labels=["edge"]
        )
        edges: dict[str, list[float]] = {}  # an edge's books summed over its replicas
        for st in snap.stages:
            # one series per worker: a replicated stage's replicas as ``1:talker#0``, ``1:talker#1``
            label = f"{st.stage_id}:{st.name}" + (f"#{st.replica}" if st.replicas > 1 else "")
            up.add_metric([label], 1.0 if st.is_alive else 0.0)
            restarts.add_metric([label], float(st.num_restarts))
            held.add_metric([label], float(st.num_requests))
            if st.queue_depth is not None:
                depth.add_metric([label], float(st.queue_depth))
            conn = _connector(st.engine)
            if conn:
                pending.add_metric([label], float(conn.get("num_pending_keys", 0)))
                live.add_metric([label], float(conn.get("live_bytes", 0)))
                moved.add_metric([label, "put"], float(conn.get("bytes_put", 0)))
                moved.add_metric([label, "got"], float(conn.get("bytes_got", 0)))
            for edge, books in _edges(st.engine).items():
                sums = edges.setdefault(edge, [0.0, 0.0])
                sums[0] += float(books.get("pending_bytes", 0))
                sums[1] += float(books.get("pending_keys", 0))
        for edge, (nbytes, nkeys) in edges.items():
            edge_bytes.add_metric([edge], nbytes)
            edge_keys.add_metric([edge], nkeys)
        yield from (up, restarts, depth, held, pending, live, moved, edge_bytes, edge_keys)


def _connector(engine: dict[str, Any] | None) -> dict[str, Any]:
    transfer = (engine or {}).get("transfer") or {}
    conn = transfer.get("connector") if isinstance(transfer, dict) else None
    return conn if isinstance(conn, dict) else {}


def _edges(engine: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    transfer = (engine or {}).get("transfer") or {}
    budget = transfer.get("budget") if isinstance(transfer, dict) else None
    edges = budget.get("edges") if isinstance(budget, dict) else None
    return edges if isinstance(edges, dict) else {}


def live_bytes(health: PipelineHealth) -> int:
    """Live transfer bytes over every stage (admission's byte budget reads this)."""
    return sum(int(_connector(st.engine).get("live_bytes", 0)) for st in health.stages)


class ServerMetrics:
    """The server's metrics; see the module docstring."""

    def __init__(self, latency_buckets_s: Sequence[float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "omnirelay_requests", "requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.aborts = Counter("omnirelay_aborts", "aborted requests by reason", ["reason"], registry=r)
        self.failures = Counter(
            "omnirelay_failures", "requests the pipeline failed", ["endpoint"], registry=r
        )
        self.in_flight = Gauge("omnirelay_requests_in_flight", "admitted requests not yet done", registry=r)
        self.websockets = Gauge(
            "omnirelay_websockets_open", "open WebSockets (connection slots held)", ["endpoint"], registry=r
        )
        self.websockets_refused = Counter(
            "omnirelay_websockets_refused",
            "WebSockets refused at the server's limit of open connections",
            ["endpoint"],
            registry=r,
        )
        buckets = tuple(latency_buckets_s)
        self.ttfa = Histogram(
            "omnirelay_time_to_first_audio_seconds",
            "submit to the first audio sample sent",
            ["endpoint"],
            buckets=buckets,
            registry=r,
        )
        self.first_playable = Histogram(
            "omnirelay_first_playable_audio_seconds",
            "submit to the earliest start of a player that never runs dry",
            ["endpoint", "model"],
            buckets=buckets,
            registry=r,
        )
        self.underruns = Counter(
            "omnirelay_audio_underruns",
            "gaps a player starting at the first audio would hear",
            ["endpoint", "model"],
            registry=r,
        )
        self.gaps = Histogram(
            "omnirelay_audio_gap_seconds",
            "length of each gap a player starting at the first audio would hear",
            ["endpoint", "model"],
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.audio_streams = Counter(
            "omnirelay_audio_streams",
            "audio streams ended, by whether their worst gap was at most 50 ms",
            ["endpoint", "model", "gap_free"],
            registry=r,
        )
        self.ttft = Histogram(
            "omnirelay_time_to_first_token_seconds",
            "submit to the first text token",
            ["endpoint"],
            buckets=buckets,
            registry=r,
        )
        self.rtf = Histogram(
            "omnirelay_real_time_factor",
            "wall time divided by audio duration",
            ["endpoint"],
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.stage_e2e = Histogram(
            "omnirelay_stage_e2e_seconds",
            "a final-output stage's own time for one request",
            ["stage"],
            buckets=buckets,
            registry=r,
        )
        self._health = _HealthCollector()
        r.register(self._health)

    def observe_playback(self, endpoint: str, model: str, playback: Playback) -> None:
        """One audio stream's end: what a listener heard of it."""
        labels = (endpoint, model)
        if playback.first_playable_s is not None:
            self.first_playable.labels(*labels).observe(playback.first_playable_s)
        if playback.num_underruns:
            self.underruns.labels(*labels).inc(playback.num_underruns)
            for gap in playback.gaps_s:
                self.gaps.labels(*labels).observe(gap)
        self.audio_streams.labels(endpoint, model, "true" if playback.is_gap_free else "false").inc()

    def update_health(self, health: PipelineHealth) -> None:
        self._health.snapshot = health

    def render(self) -> bytes:
        return generate_latest(self.registry)
