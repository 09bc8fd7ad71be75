"""omnirelay.payload."""
