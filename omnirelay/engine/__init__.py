"""omnirelay.engine."""
