"""What a received chunk commits into a request (SPEC §4.8), as pure functions.

:func:`prepare_chunk` does the per-payload work (flags, codes → prompt ids, a dict view)
outside any lock; :func:`merge_runtime_info` folds it into the request's previous runtime
info, cheaply, under the receiver lock together with the identity check.

* AR receivers (Talker-like): the payload is handed on as is; the scheduler applies it as
  a pending prompt update.
* Generation receivers (Code2Wav-like): ``codes.audio`` becomes the prompt — a 1-D tensor
  or a list as ids, a ≥2-D tensor as the placeholder ``[0]`` (``[]`` if empty) while the
  tensor stays in the runtime info — and the payload is merged into the runtime info
  (from empty when ``meta.replace_runtime_additional_information``): maps key by key,
  scalars overwrite, ``meta.finished`` never copied.
* Empty non-terminal generation chunk (no ids, not finished, not a segment end): consumed
  (the counter moves on) but not ready. An empty segment-end chunk gets the prompt ``[0]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from omnirelay.transfer.payload_view import as_mapping, field, flag_value, is_empty_payload

__all__ = ["PreparedChunk", "is_empty_nonterminal", "merge_runtime_info", "prepare_chunk"]


class PreparedChunk(NamedTuple):
    """One received payload, read (immutable). A NamedTuple: one is built per chunk on the
    receive path, where a frozen dataclass costs several times as much to build."""

    payload: Any
    is_finished: bool
    is_segment_finished: bool
    #: Generation receivers only: the prompt this chunk runs on.
    prompt_token_ids: list[int] | None = None
    #: Generation receivers only: top-level fields to merge (codes already filtered).
    fields: dict[str, Any] | None = None
    replaces_info: bool = False


def _is_map_like(value: Any) -> bool:
    return isinstance(value, Mapping | msgspec.Struct) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def _codes_to_prompt(codes: dict[str, Any]) -> list[int]:
    """Turn ``codes["audio"]`` into prompt ids; removes it from ``codes`` when it became ids."""
    audio = codes.get("audio")
    if audio is None:
        return []
    if isinstance(audio, list | tuple):
        del codes["audio"]
        return [int(x) for x in audio]
    ndim = getattr(audio, "ndim", None)
    if not isinstance(ndim, int):
        raise TypeError(f"codes.audio must be a tensor or a list, got {type(audio).__name__}")
    if ndim <= 1:
        del codes["audio"]
        return [int(x) for x in audio.reshape(-1).tolist()]
    numel = audio.numel() if callable(getattr(audio, "numel", None)) else int(audio.size)
    return [0] if numel else []


def prepare_chunk(kind: str, payload: Any) -> PreparedChunk:
    """Read one received payload. Raises ValueError/TypeError on a contract violation."""
    if is_empty_payload(payload):
        raise ValueError(f"received an empty payload ({type(payload).__name__})")
    if kind == "ar":  # the payload is handed on as is: read its flags only, copy nothing
        if not (type(payload) is dict or _is_map_like(payload)):
            raise TypeError(f"payload part of type {type(payload).__name__} is not a mapping or a struct")
        meta_part = field(payload, "meta")
        if meta_part is None:
            return PreparedChunk(payload, False, False)
        if not (type(meta_part) is dict or _is_map_like(meta_part)):
            raise TypeError(f"payload part of type {type(meta_part).__name__} is not a mapping or a struct")
        return PreparedChunk(
            payload,
            flag_value(field(meta_part, "finished")),
            flag_value(field(meta_part, "is_segment_finished")),
        )
    fields = as_mapping(payload)
    meta_obj = fields.get("meta")
    meta = as_mapping(meta_obj) if meta_obj is not None else {}
    finished = flag_value(meta.get("finished"))
    segment = flag_value(meta.get("is_segment_finished"))
    codes_obj = fields.get("codes")
    prompt: list[int] = []
    if codes_obj is not None:
        codes = as_mapping(codes_obj)
        prompt = _codes_to_prompt(codes)
        fields["codes"] = codes
    if not prompt and segment:
        prompt = [0]  # the segment boundary still runs
    if meta_obj is not None:
        fields["meta"] = {k: v for k, v in meta.items() if k != "finished"}
    return PreparedChunk(
        payload,
        finished,
        segment,
        prompt_token_ids=prompt,
        fields=fields,
        replaces_info=flag_value(meta.get("replace_runtime_additional_information")),
    )


def is_empty_nonterminal(chunk: PreparedChunk) -> bool:
    return (
        chunk.prompt_token_ids is not None
        and not chunk.prompt_token_ids
        and not chunk.is_finished
        and not chunk.is_segment_finished
    )


def merge_runtime_info(previous: dict[str, Any] | None, chunk: PreparedChunk) -> dict[str, Any]:
    """A new dict: ``previous`` (or empty) with ``chunk``'s fields merged in. Never mutates."""
    assert chunk.fields is not None, "merge_runtime_info is for generation receivers"
    merged: dict[str, Any] = {} if chunk.replaces_info or previous is None else dict(previous)
    for key, value in chunk.fields.items():
        if _is_map_like(value):
            old = merged.get(key)
            sub = dict(old) if isinstance(old, dict) else {}
            sub.update(as_mapping(value))
            merged[key] = sub
        else:
            merged[key] = value
    return merged
