"""The HTTP and WebSocket endpoints of the OpenAI-compatible API: chat completions,
speech, and the streaming speech WebSocket."""
