"""omnirelay.connectors."""
