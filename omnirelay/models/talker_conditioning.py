"""The Talker's conditioning, built for all of a step's new requests at once.

A request's first Talker input (docs/protocol.md §5.1; the layout is described in
:mod:`omnirelay.models.talker`) is made of rows of the Thinker's chunk 0, each through
one of the Talker's projections, plus codec embeddings:

* user turn: text positions through ``text_projection``, multimodal positions (audio,
  image, video tokens) from the accept-layer hidden states through ``hidden_projection``;
* assistant turn: header (3 rows), 4 × TTS pad, TTS BOS, first text token — all text
  rows — summed with the codec rows (no-think, think BOS/EOS, speaker, codec pad, codec
  BOS; nothing under the header);
* the rest of the assistant rows and any decode rows that came with chunk 0 are queued
  as the request's next text rows.

Built one request at a time this is some thirty small launches and a device sync per
request (tens of ms for 64 new requests, with the GPU idle). :func:`build_conditionings`
plans every row on the host first and then runs, for the whole step: one host→device
copy of the rows, one ``text_projection``, one ``hidden_projection``, one codec
embedding lookup and two gathers. Each projection works row by row, so a request's
conditioning does not depend on the others in its step (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.errors import ModelError
from omnirelay.models.talker_input import ThinkerChunk, assistant_start, user_positions

__all__ = ["DEFAULT_SPEAKER", "Conditioning", "build_conditionings"]

DEFAULT_SPEAKER = "ethan"

#: The assistant turn's header rows (``<|im_start|>assistant\n``).
_HEADER = 3
#: TTS pad rows between the header and TTS BOS.
_PADS = 4


@dataclass(slots=True)
class Conditioning:
    """One request's first input and the state its later steps start from."""

    embeds: torch.Tensor  # [L, H] on the Talker's device
    tts_eos: torch.Tensor  # [1, H], projected
    tts_pad: torch.Tensor
    #: projected text rows [1, H] for the next steps, in order
    text_rows: list[torch.Tensor] = field(default_factory=list)
    #: the Thinker ended before its first token was fed back: only EOS will be spoken
    is_eos_fed: bool = False


@dataclass(slots=True)
class _Plan:
    """Where one request's rows come from: indices into the step's projected pools."""

    text_at: int  # its first row in the text pool
    mm_at: int  # its first row in the multimodal pool
    users: list[tuple[bool, int]]  # (is multimodal, row in its own text or mm block)
    text_positions: list[int]  # prompt positions of its user text rows
    mm_positions: list[int]  # … and of its multimodal ones
    num_user_text: int
    num_assistant: int
    num_decode: int
    codec_ids: list[int]


def _plan(spec: Any, rid: str, chunk: ThinkerChunk, text_at: int, mm_at: int) -> _Plan:
    assert chunk.prefill_embed is not None
    prompt = chunk.prompt_ids
    rows = chunk.prefill_embed.shape[0]
    start = assistant_start(prompt, spec.im_start_token_id, spec.assistant_token_id)
    if start is None:
        raise ModelError(
            f"request {rid!r}: the Thinker prompt has no '<|im_start|>assistant' turn; the Talker needs the "
            "chat layout (see omnirelay.models.tokenizer.encode_chat_prompt)"
        )
    speaker = (chunk.speaker or DEFAULT_SPEAKER).lower()
    if speaker not in spec.speaker_ids:
        raise ModelError(f"request {rid!r}: unknown speaker {speaker!r}; known: {sorted(spec.speaker_ids)}")
    users: list[tuple[bool, int]] = []
    text_positions: list[int] = []
    mm_positions: list[int] = []
    for p in user_positions(prompt, spec.im_start_token_id, spec.user_token_id):
        if p >= rows:
            continue
        is_mm = prompt[p] in spec.multimodal_token_ids
        own = mm_positions if is_mm else text_positions
        users.append((is_mm, len(own)))
        own.append(p)
    codec_ids = [
        spec.codec_nothink_id,
        spec.codec_think_bos_id,
        spec.codec_think_eos_id,
        spec.speaker_ids[speaker],
        spec.codec_pad_id,
        spec.codec_bos_id,
    ]
    decode = chunk.decode_embed.shape[0] if chunk.decode_embed is not None else 0
    return _Plan(
        text_at=text_at,
        mm_at=mm_at,
        users=users,
        text_positions=text_positions,
        mm_positions=mm_positions,
        num_user_text=len(text_positions),
        num_assistant=max(0, rows - start),
        num_decode=decode,
        codec_ids=codec_ids,
    )


def _text_block(chunk: ThinkerChunk, plan: _Plan) -> list[torch.Tensor]:
    """The rows of one request that go through ``text_projection``, in pool order:
    user text rows, assistant rows, TTS BOS/EOS/pad, decode rows."""
    embed = chunk.prefill_embed
    assert embed is not None and chunk.tts_bos is not None and chunk.tts_eos is not None
    assert chunk.tts_pad is not None
    out = [embed[plan.text_positions]] if plan.text_positions else []
    out += [embed[embed.shape[0] - plan.num_assistant :], chunk.tts_bos, chunk.tts_eos, chunk.tts_pad]
    if chunk.decode_embed is not None:
        out.append(chunk.decode_embed)
    return out


def _to_device(pieces: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of all rows on ``device``: joined on the host and copied once when
    they are all host rows (the shm connector's case)."""
    if all(p.device.type == "cpu" for p in pieces):
        return torch.cat([p.reshape(-1, p.shape[-1]) for p in pieces]).to(device, dtype)
    return torch.cat([p.reshape(-1, p.shape[-1]).to(device, dtype) for p in pieces])


def build_conditionings(
    model: Any,
    spec: Any,
    chunks: Sequence[tuple[str, ThinkerChunk]],
    device: torch.device,
    dtype: torch.dtype,
) -> list[Conditioning]:
    """The conditioning of each ``(request id, chunk 0)``; see the module docstring.
    ``model`` is the Talker (``text_projection``, ``hidden_projection``, codec embedding);
    ``spec`` its :class:`~omnirelay.models.talker.TalkerSpec`."""
    plans: list[_Plan] = []
    text_pieces: list[torch.Tensor] = []
    mm_pieces: list[torch.Tensor] = []
    text_at = mm_at = 0
    for rid, chunk in chunks:
        if chunk.prefill_embed is None or chunk.prefill_hidden is None:
            raise ModelError(f"request {rid!r}: the Talker's first input has no prefill rows")
        plan = _plan(spec, rid, chunk, text_at, mm_at)
        block = _text_block(chunk, plan)
        text_pieces += block
        text_at += sum(p.reshape(-1, p.shape[-1]).shape[0] for p in block)
        if plan.mm_positions:
            mm_pieces.append(chunk.prefill_hidden[plan.mm_positions])
            mm_at += len(plan.mm_positions)
        plans.append(plan)
    text = model.text_projection(_to_device(text_pieces, device, dtype))
    pools = [text]
    if mm_pieces:
        pools.append(model.hidden_projection(_to_device(mm_pieces, device, dtype)))
    codec_ids = torch.tensor([i for plan in plans for i in plan.codec_ids], device=device)
    codec = model.get_input_embeddings()(codec_ids)
    rows = torch.cat(pools) if len(pools) > 1 else text
    codec_rows = torch.cat([codec, torch.zeros_like(codec[:1])])  # the last: no codec row
    return _assemble(plans, rows, codec_rows, text.shape[0], device)


def _assemble(
    plans: list[_Plan], rows: torch.Tensor, codec_rows: torch.Tensor, mm_base: int, device: torch.device
) -> list[Conditioning]:
    """Each request's ``[L, H]`` = two gathers (its text/mm rows + its codec rows) of the
    step's pools, done for all requests at once and split."""
    codec_zero = codec_rows.shape[0] - 1
    text_idx: list[int] = []
    codec_idx: list[int] = []
    lengths = []
    for r, plan in enumerate(plans):
        assistant = plan.text_at + plan.num_user_text
        bos, eos, pad = (assistant + plan.num_assistant + k for k in range(3))
        for is_mm, k in plan.users:
            text_idx.append(mm_base + plan.mm_at + k if is_mm else plan.text_at + k)
        header = [assistant + k if k < plan.num_assistant else pad for k in range(_HEADER)]
        first_text = assistant + _HEADER if plan.num_assistant > _HEADER else eos
        text_idx += [*header, *[pad] * _PADS, bos, first_text]
        codec_idx += [codec_zero] * (len(plan.users) + _HEADER) + [6 * r + k for k in range(6)]
        lengths.append(len(plan.users) + _HEADER + _PADS + 2)
    embeds = rows[torch.tensor(text_idx, device=device)] + codec_rows[torch.tensor(codec_idx, device=device)]
    out = []
    for plan, block in zip(plans, torch.split(embeds, lengths)):
        assistant = plan.text_at + plan.num_user_text
        eos = assistant + plan.num_assistant + 1
        queued = list(range(assistant + _HEADER + 1, assistant + plan.num_assistant))
        queued += list(range(eos + 2, eos + 2 + plan.num_decode))
        out.append(
            Conditioning(
                embeds=block,
                tts_eos=rows[eos : eos + 1],
                tts_pad=rows[eos + 1 : eos + 2],
                text_rows=[rows[i : i + 1] for i in queued],
                is_eos_fed=plan.num_assistant <= _HEADER,
            )
        )
    return out
