"""Deterministic toy executors and processors for tests, demos and benchmarks of the
runtime without a model."""
