"""omnirelay.cli."""
