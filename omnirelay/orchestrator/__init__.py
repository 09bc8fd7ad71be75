"""omnirelay.orchestrator."""
