"""omnirelay.models."""
