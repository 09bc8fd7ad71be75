"""Shared pieces of the realtime tests: synthesized speech-like signals with known edges,
and a small ``websockets`` client that reads events by type."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets


def speechlike(rate: int, seconds: float, *, level: float = 0.3, seed: int = 0) -> np.ndarray:
    """A voiced sound: harmonics of a gliding 120-160 Hz pitch, its loudness swinging at a
    syllable rate of 4 Hz (never to silence), 10 ms ramps at both ends. float32."""
    n = round(rate * seconds)
    t = np.arange(n) / rate
    f0 = 140 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    rng = np.random.default_rng(seed)
    voice = sum(np.sin(k * phase + rng.uniform(0, 6.28)) / k for k in range(1, 12))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)
    ramp = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / (0.01 * rate))
    x = voice * envelope * ramp
    return (level * x / np.max(np.abs(x))).astype(np.float32)


def noise(rate: int, seconds: float, *, db: float = -60.0, seed: int = 1) -> np.ndarray:
    """White noise at ``db`` dBFS (its mean power)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(round(rate * seconds)) * 10 ** (db / 20)).astype(np.float32)


def utterance(rate: int, lead_s: float, speech_s: float, tail_s: float, **kw: Any) -> np.ndarray:
    """Background noise throughout, speech from ``lead_s`` for ``speech_s``."""
    out = noise(rate, lead_s + speech_s + tail_s)
    start = round(lead_s * rate)
    speech = speechlike(rate, speech_s, **kw)
    out[start : start + speech.size] += speech
    return out


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


def append_events(samples: np.ndarray, rate: int, chunk_ms: int = 100) -> list[str]:
    """``input_audio_buffer.append`` events of ``chunk_ms`` each."""
    step = rate * chunk_ms // 1000
    return [
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(pcm16(samples[i : i + step])).decode(),
            }
        )
        for i in range(0, samples.size, step)
    ]


@dataclass
class Received:
    event: dict[str, Any]
    at: float  # time.monotonic() when it arrived


@dataclass
class RealtimeClient:
    """One session over ``websockets``; every event received is kept with its arrival time."""

    ws: Any
    events: list[Received] = field(default_factory=list)

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> RealtimeClient:
        client = cls(await websockets.connect(url, max_size=2**24, **kwargs))
        created = await client.next()
        assert created["type"] == "session.created", created
        return client

    async def send(self, event: dict[str, Any] | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, str | bytes) else json.dumps(event))

    async def next(self, timeout: float = 60.0) -> dict[str, Any]:
        raw = await asyncio.wait_for(self.ws.recv(), timeout)
        event = json.loads(raw)
        self.events.append(Received(event, time.monotonic()))
        return event

    async def until(self, kind: str, timeout: float = 60.0) -> dict[str, Any]:
        """Read events until one of type ``kind`` (returned)."""
        deadline = time.monotonic() + timeout
        while True:
            event = await self.next(max(0.1, deadline - time.monotonic()))
            if event["type"] == kind:
                return event

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r.event for r in self.events if r.event["type"] == kind]

    def at(self, event: dict[str, Any]) -> float:
        return next(r.at for r in self.events if r.event is event)

    async def close(self) -> None:
        await self.ws.close()

    async def text_turn(self, text: str, response: dict[str, Any] | None = None) -> dict[str, Any]:
        """A user message, then a response; returns ``response.done``."""
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await self.send({"type": "conversation.item.create", "item": item})
        await self.send({"type": "response.create", **({"response": response} if response else {})})
        return await self.until("response.done", timeout=120)


def pcm_of(events: list[dict[str, Any]], response_id: str) -> bytes:
    return b"".join(
        base64.b64decode(e["delta"])
        for e in events
        if e["type"] == "response.audio.delta" and e["response_id"] == response_id
    )
