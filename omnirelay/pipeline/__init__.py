"""omnirelay.pipeline."""
