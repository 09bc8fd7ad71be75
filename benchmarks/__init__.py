"""omnirelay's benchmarks: measurements of a source checkout, not part of the product.

Run them with ``omnirelay bench BENCH`` (or ``python -m benchmarks BENCH``) from the
repository's root; ``cli.py`` holds every option. This package imports omnirelay; omnirelay
never imports it (``omnirelay bench`` loads it on use).

* ``transfer.py`` — ``bench transfer``: the shm connector's one-way latency and
  throughput across processes, beside two memcpy and a pickle baseline.
* ``stress.py`` (``stress_plan.py``, ``stress_producer.py``, ``stress_consumer.py``) —
  ``bench stress``: cross-process transfers with cancellations, id reuse and early-stopping
  consumers, then a leak audit.
* ``adapter_latency.py`` (``adapter_latency_roles.py``) — ``bench adapter``: the transfer
  adapter's own cost per codec chunk, and head-of-line blocking behind 64 MB payloads.
* ``pipeline.py`` — ``bench pipeline``: time to first audio and runtime overhead of the
  tiny Qwen3-Omni pipeline (:mod:`omnirelay.timeline`).
* ``serve.py`` — ``bench serve``: a load generator for the OpenAI-compatible server.
* ``pair_adapter_runs.py`` — ``python -m benchmarks.pair_adapter_runs``: ``bench adapter``
  under two interpreters or two checkouts (``--a-path`` / ``--b-path``), alternating run
  by run, for before/after comparisons on a machine whose speed drifts.
* ``soak_pipeline.py`` — ``python -m benchmarks.soak_pipeline``: hundreds of concurrent
  requests with random aborts through the toy pipeline, then the idle CPU cost of
  requests parked for chunks; leak audits throughout.
* ``tracing.py`` — :class:`~benchmarks.tracing.TracingConnector`, a counting connector
  wrapper the transfer benchmarks inject.
* ``anchor.py`` — the shm connector as a transport of an external transfer-anchor harness.
"""
