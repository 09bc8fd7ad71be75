"""omnirelay.transfer."""
