"""What the Talker reads from the Thinker → Talker payloads (docs/protocol.md §5.1), checked.

* :func:`parse_payload` — one committed payload (the
  :class:`~omnirelay.payload.OmniPayload` that
  :class:`~omnirelay.processors.ThinkerToTalkerProcessor` built) → :class:`ThinkerChunk`.
* :class:`ThinkerChunk` — chunk 0 (``prefill``: embeddings and accept-layer hidden
  states of the prompt and the first generated position(s), all token ids, the prompt
  ids, the TTS BOS/EOS/PAD embeddings, the speaker) or a later chunk (``decode``: one
  embedding row per new Thinker token), plus ``is_finished`` (the Thinker's stream
  ended: the engine says so, ``BatchItem.is_upstream_exhausted``; the payload does not).
* :func:`assistant_start` / :func:`user_positions` — where the open assistant turn
  starts and which prompt positions belong to user turns (the Qwen chat layout).

Shapes are checked here so that the executor's errors name the payload field at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnirelay.errors import ModelError
from omnirelay.models.runner.graphs import used_here
from omnirelay.payload.schema import OmniPayload

__all__ = ["ThinkerChunk", "assistant_start", "parse_payload", "user_positions"]


@dataclass(frozen=True, slots=True)
class ThinkerChunk:
    """One Thinker → Talker chunk, as the Talker needs it."""

    is_finished: bool
    #: chunk 0: layer-0 rows [N, H] and accept-layer rows [N, H] of positions 0..N-1
    prefill_embed: torch.Tensor | None = None
    prefill_hidden: torch.Tensor | None = None
    token_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    tts_bos: torch.Tensor | None = None
    tts_eos: torch.Tensor | None = None
    tts_pad: torch.Tensor | None = None
    speaker: str | None = None
    #: later chunks: layer-0 rows [n, H] of the new Thinker tokens
    decode_embed: torch.Tensor | None = None

    @property
    def is_prefill(self) -> bool:
        return self.prefill_embed is not None


def _rows(value: Any, what: str, request: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value) if value is not None else None
    if value is None or not value.is_floating_point():
        raise ModelError(f"request {request!r}: payload {what} must be a floating point tensor [rows, H]")
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 2:
        raise ModelError(
            f"request {request!r}: payload {what} must be [rows, H], got shape {tuple(value.shape)}"
        )
    # In a device group the Thinker's rows come by reference, made on its stream and read
    # here on the Talker's: their memory waits for this stream's reads when they are freed.
    return used_here(value)


def _ids(value: Any, what: str, request: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(t) for t in value.reshape(-1).tolist())
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ModelError(f"request {request!r}: payload {what} must be a list of token ids")
    return tuple(int(t) for t in value)


def parse_payload(payload: Any, request: str, *, is_finished: bool) -> ThinkerChunk:
    """Read one payload; raise :class:`ModelError` naming the field if it is malformed.

    ``is_finished``: no Thinker chunk comes after this one.
    """
    if type(payload) is not OmniPayload:
        raise ModelError(
            f"request {request!r}: a Thinker → Talker payload must be an OmniPayload, got {type(payload).__name__}"
        )
    embed = payload.embed or {}
    prefill = embed.get("prefill")
    decode = embed.get("decode")
    if prefill is None:
        rows = None if decode is None else _rows(decode, "embed.decode", request)
        return ThinkerChunk(is_finished=is_finished, decode_embed=rows)
    prefill_embed = _rows(prefill, "embed.prefill", request)
    prefill_hidden = _rows((payload.hidden_states or {}).get("output"), "hidden_states.output", request)
    ids = payload.ids or {}
    token_ids = _ids(ids.get("all"), "ids.all", request)
    prompt_ids = _ids(ids.get("prompt"), "ids.prompt", request)
    if (
        not prompt_ids
        or len(token_ids) < prefill_embed.shape[0]
        or token_ids[: len(prompt_ids)] != prompt_ids
    ):
        raise ModelError(
            f"request {request!r}: chunk 0 needs ids.prompt (got {len(prompt_ids)} ids) and ids.all covering "
            f"the {prefill_embed.shape[0]} prefill rows and starting with the prompt (got {len(token_ids)} ids)"
        )
    # Hidden states matter for prompt positions only (multimodal inputs); a complete
    # input may carry embeddings of every generated token but hidden states of chunk 0.
    needed = min(prefill_embed.shape[0], len(prompt_ids))
    if prefill_hidden.shape[0] < needed or prefill_hidden.shape[0] > prefill_embed.shape[0]:
        raise ModelError(
            f"request {request!r}: hidden_states.output has {prefill_hidden.shape[0]} rows; it must cover the "
            f"{needed} prompt rows and at most the {prefill_embed.shape[0]} rows of embed.prefill"
        )
    tts: dict[str, torch.Tensor] = {}
    for name in ("tts_bos", "tts_eos", "tts_pad"):
        value = embed.get(name)
        if value is None:
            raise ModelError(f"request {request!r}: chunk 0 lacks embed.{name}; the Thinker must send it")
        row = _rows(value, f"embed.{name}", request)
        if row.shape != (1, prefill_embed.shape[1]):
            raise ModelError(
                f"request {request!r}: embed.{name} must be one row [1, {prefill_embed.shape[1]}], "
                f"got {tuple(row.shape)}"
            )
        tts[name] = row
    speaker = payload.speaker
    return ThinkerChunk(
        is_finished=is_finished,
        prefill_embed=prefill_embed,
        prefill_hidden=prefill_hidden,
        token_ids=token_ids,
        prompt_ids=prompt_ids,
        tts_bos=tts["tts_bos"],
        tts_eos=tts["tts_eos"],
        tts_pad=tts["tts_pad"],
        speaker=speaker if isinstance(speaker, str) and speaker else None,
        decode_embed=None if decode is None else _rows(decode, "embed.decode", request),
    )


def assistant_start(prompt_ids: Sequence[int], im_start: int, assistant: int) -> int | None:
    """Index of the last ``<|im_start|>assistant`` pair in the prompt (None if absent)."""
    for i in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[i] == im_start and prompt_ids[i + 1] == assistant:
            return i
    return None


def user_positions(prompt_ids: Sequence[int], im_start: int, user: int) -> list[int]:
    """Prompt positions inside user turns: from a turn's ``<|im_start|>`` (whose next token
    is ``user``) up to the next ``<|im_start|>``. Positions before the first turn start
    take the role of the prompt's second token, as the reference does."""
    out: list[int] = []
    n = len(prompt_ids)
    turn_start = 0
    for p, token in enumerate(prompt_ids):
        if token == im_start:
            turn_start = p
        role = prompt_ids[min(turn_start + 1, n - 1)]
        if role == user:
            out.append(p)
    return out
