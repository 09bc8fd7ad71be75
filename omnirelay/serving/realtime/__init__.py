"""``/v1/realtime``: the session and its events, its responses, the conversation, the
server VAD and the ``--ui`` page."""
