"""omnirelay.serving."""
