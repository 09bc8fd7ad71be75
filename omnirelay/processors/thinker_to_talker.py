"""Thinker → Talker: hand the Talker the Thinker's embeddings and hidden states (docs/protocol.md §5.1).

* :class:`ThinkerStreamState` — per request: the prompt ids, speaker, language, and the
  rows cached while chunk 0 waits.
* :class:`ThinkerToTalkerProcessor` — ``new_state()`` once per request, then ``step()``
  once per Thinker scheduler step on the save thread, until it is called with
  ``finished`` (then it always returns a payload, and the state is spent).

Chunk 0 carries the prefill: ``embed.prefill`` (layer-0 rows), ``hidden_states.output``
(rows of layer ``accept_hidden_layer``), the TTS BOS/EOS/PAD embeddings, ``ids.all`` and
``ids.prompt``. It is released only once it covers the whole prompt plus at least one
generated position (or the request finished): that is the least the Talker can start
from, and chunked prefill accumulates through the same cache. Every later chunk carries
``embed.decode``: the layer-0 rows of that step.

Tensors stay where the Thinker put them: on its device when its edge to the Talker is
GPU-direct (docs/protocol.md §3.9; the connector then moves them device to device, or
straight from the device into its slot), on the host otherwise.

Beyond the reference (docs/protocol.md §10.10): a decode step of several rows (speculative or
multi-token decode) is sent as several rows instead of being dropped, and every tensor's
shape is checked with an error that names it. A step output without the captured layers
is an error too, not a silent skip: the Talker would otherwise wait for a chunk that
never comes. The resumable (realtime) session path of the reference is not built here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from omnirelay.errors import ConfigError, PayloadEncodeError
from omnirelay.payload.schema import OmniPayload, TensorLike
from omnirelay.processors.base import check_chunk_id

__all__ = ["EMBEDDING_LAYER", "ThinkerStreamState", "ThinkerToTalkerProcessor"]

#: The captured "layer" that holds the input embeddings.
EMBEDDING_LAYER = 0

_PROCESSOR = "thinker->talker"


@dataclass(slots=True)
class ThinkerStreamState:
    """One request's Thinker → Talker stream; written only by the save thread."""

    prompt_ids: list[int]
    speaker: str | None = None
    language: str | None = None
    cached_embed: list[torch.Tensor] = field(default_factory=list)
    cached_hidden: list[torch.Tensor] = field(default_factory=list)
    num_cached_rows: int = 0
    tts_embeds: dict[str, torch.Tensor] = field(default_factory=dict)
    embed_size: int | None = None
    hidden_size: int | None = None
    num_payloads: int = 0
    is_finished: bool = False


class ThinkerToTalkerProcessor:
    """Builds Talker payloads from Thinker steps. Stateless across requests."""

    def __init__(self, accept_hidden_layer: int) -> None:
        if isinstance(accept_hidden_layer, bool) or not isinstance(accept_hidden_layer, int):
            raise ConfigError(
                f"accept_hidden_layer must be an int (the talker config's layer index), got {accept_hidden_layer!r}"
            )
        if accept_hidden_layer < 0:
            raise ConfigError(f"accept_hidden_layer must be >= 0, got {accept_hidden_layer}")
        self.accept_hidden_layer = accept_hidden_layer

    def new_state(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        speaker: str | None = None,
        language: str | None = None,
    ) -> ThinkerStreamState:
        """Per-request state; ``prompt_ids`` are the Thinker's prompt token ids."""
        return ThinkerStreamState(
            prompt_ids=_as_id_list(prompt_ids, "prompt_ids"), speaker=speaker, language=language
        )

    # ---- called once per Thinker step, on the save thread

    def step(
        self,
        state: ThinkerStreamState,
        hidden_layers: Mapping[int | str, torch.Tensor],
        *,
        chunk_id: int,
        finished: bool,
        token_ids: Sequence[int] | torch.Tensor,
        tts_bos: torch.Tensor | None = None,
        tts_eos: torch.Tensor | None = None,
        tts_pad: torch.Tensor | None = None,
    ) -> OmniPayload | None:
        """Take this step's captured layers and return the payload to put now, or ``None``.

        ``hidden_layers`` maps a layer index (int or str) to this step's rows ``[n, H]``
        (``[H]`` is one row); layer 0 holds the input embeddings. ``token_ids`` are all
        token ids so far (prompt and generated). ``chunk_id`` is the adapter's count of
        successful puts for this request on this edge. When ``finished`` is true a payload
        is always returned.
        """
        if state.is_finished:
            raise PayloadEncodeError(f"{_PROCESSOR}: step() called after the stream finished")
        check_chunk_id(chunk_id, state.num_payloads, processor=_PROCESSOR)
        if not isinstance(hidden_layers, Mapping):
            raise PayloadEncodeError(
                f"{_PROCESSOR}: the step output must map layer index -> tensor, got {type(hidden_layers).__name__}"
            )
        embed = self._rows(hidden_layers, EMBEDDING_LAYER, "embedding layer 0", state, is_hidden=False)
        if chunk_id > 0:
            return self._decode_chunk(state, embed, finished=finished)

        hidden = self._rows(
            hidden_layers,
            self.accept_hidden_layer,
            f"accept_hidden_layer {self.accept_hidden_layer}",
            state,
            is_hidden=True,
        )
        if hidden.shape[0] != embed.shape[0]:
            raise PayloadEncodeError(
                f"{_PROCESSOR}: layer 0 has {embed.shape[0]} row(s) but accept_hidden_layer "
                f"{self.accept_hidden_layer} has {hidden.shape[0]}; both must cover the same positions"
            )
        for name, value in (("tts_bos", tts_bos), ("tts_eos", tts_eos), ("tts_pad", tts_pad)):
            if value is not None:
                state.tts_embeds[name] = self._tts_embed(name, value, state)
        if embed.shape[0] > 0:
            state.cached_embed.append(embed)
            state.cached_hidden.append(hidden)
            state.num_cached_rows += embed.shape[0]
        if not finished and state.num_cached_rows <= len(state.prompt_ids):
            return None  # not yet the whole prompt plus one generated position
        return self._first_chunk(state, token_ids, finished=finished)

    # ---- payloads

    def _first_chunk(
        self, state: ThinkerStreamState, token_ids: Sequence[int] | torch.Tensor, *, finished: bool
    ) -> OmniPayload:
        embed: dict[str, TensorLike] = dict(state.tts_embeds)
        hidden_states: dict[str, TensorLike] = {}
        if state.cached_embed:
            embed["prefill"] = torch.cat(state.cached_embed, dim=0)
            hidden_states["output"] = torch.cat(state.cached_hidden, dim=0)
        state.cached_embed.clear()
        state.cached_hidden.clear()
        state.num_cached_rows = 0
        payload = OmniPayload(
            embed=embed or None,
            hidden_states=hidden_states or None,
            ids={"all": _as_id_list(token_ids, "token_ids"), "prompt": list(state.prompt_ids)},
            speaker=state.speaker,
            language=state.language,
        )
        self._sent(state, finished)
        return payload

    def _decode_chunk(
        self, state: ThinkerStreamState, embed: torch.Tensor, *, finished: bool
    ) -> OmniPayload | None:
        if embed.shape[0] == 0 and not finished:
            return None
        payload = OmniPayload(
            embed={"decode": embed} if embed.shape[0] > 0 else None,
            speaker=state.speaker,
            language=state.language,
        )
        self._sent(state, finished)
        return payload

    @staticmethod
    def _sent(state: ThinkerStreamState, finished: bool) -> None:
        state.num_payloads += 1
        if finished:
            state.is_finished = True
            state.tts_embeds.clear()

    # ---- input checks

    def _rows(
        self,
        hidden_layers: Mapping[int | str, torch.Tensor],
        layer: int,
        what: str,
        state: ThinkerStreamState,
        *,
        is_hidden: bool,
    ) -> torch.Tensor:
        value = hidden_layers.get(layer)
        if value is None:
            value = hidden_layers.get(str(layer))
        if value is None:
            raise PayloadEncodeError(
                f"{_PROCESSOR}: {what} was not captured (keys: {sorted(map(str, hidden_layers))}); "
                f"the Thinker must capture layers 0 and {self.accept_hidden_layer}"
            )
        if not isinstance(value, torch.Tensor):
            raise PayloadEncodeError(f"{_PROCESSOR}: {what} must be a tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise PayloadEncodeError(f"{_PROCESSOR}: {what} must be floating point, got {value.dtype}")
        rows = value.detach()
        if rows.dim() == 1:
            rows = rows.unsqueeze(0)
        if rows.dim() != 2:
            raise PayloadEncodeError(
                f"{_PROCESSOR}: {what} must be [rows, hidden] (or [hidden]), got shape {tuple(value.shape)}"
            )
        expected = state.hidden_size if is_hidden else state.embed_size
        if expected is None:
            if is_hidden:
                state.hidden_size = rows.shape[1]
            else:
                state.embed_size = rows.shape[1]
        elif rows.shape[1] != expected:
            raise PayloadEncodeError(
                f"{_PROCESSOR}: {what} has width {rows.shape[1]}, earlier steps had {expected}"
            )
        return rows  # where the Thinker put them: on its device when the edge is GPU-direct

    @staticmethod
    def _tts_embed(name: str, value: object, state: ThinkerStreamState) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise PayloadEncodeError(f"{_PROCESSOR}: {name} must be a floating point tensor, got {value!r}")
        t = value.detach()
        if t.dim() == 1:
            t = t.unsqueeze(0)
        width = state.embed_size
        if t.dim() != 2 or t.shape[0] != 1 or (width is not None and t.shape[1] != width):
            raise PayloadEncodeError(
                f"{_PROCESSOR}: {name} must be one embedding row [1, {width if width is not None else 'H'}], "
                f"got shape {tuple(value.shape)}"
            )
        return t


def _as_id_list(ids: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() > 1:
            raise PayloadEncodeError(
                f"{_PROCESSOR}: {what} must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        return [int(t) for t in ids.reshape(-1).tolist()]
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise PayloadEncodeError(f"{_PROCESSOR}: {what} must be a sequence of ints, got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise PayloadEncodeError(f"{_PROCESSOR}: {what} must contain ints, got {t!r}")
        out.append(t)
    return out
