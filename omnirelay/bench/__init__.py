"""Benchmarks behind `omnirelay bench` (scripts, never timed unit tests)."""
