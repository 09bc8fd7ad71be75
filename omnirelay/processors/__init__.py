"""omnirelay.processors."""
