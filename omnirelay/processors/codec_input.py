"""What a generation stage makes of a committed codec chunk (docs/protocol.md §4.8).

A Code2Wav-like stage computes every chunk it receives as a fresh one-shot prefill. This
is its :data:`~omnirelay.engine.interfaces.ChunkReader` (Code2Wav's and the toy
generator's ``read_chunk``), run by the generation scheduler on the engine thread once
per committed chunk:

* :func:`read_codec_chunk` ``(runtime_info, payload) -> (prompt_token_ids, runtime_info)``
  — the chunk's ``codes.audio`` becomes the step's prompt, the rest of the
  :class:`~omnirelay.payload.OmniPayload` is merged into the request's runtime info;
* :func:`merge_runtime_info` — that merge alone.

``codes.audio`` as the prompt: a 1-D tensor (or array, or list of ints: codebook-major
``Q·T`` ids) becomes the ids and leaves the runtime info; a ≥2-D tensor stays in the
runtime info (the executor decodes it from there) and the prompt is the placeholder
``[0]`` (``[]`` when it has no element); no audio gives ``[]``. A chunk with no body (a
boundary with nothing new) leaves the runtime info as it was. What an empty prompt means
(wait for the next chunk, run a segment end, finish) is the scheduler's business.

The merge starts from the previous runtime info, or from nothing when the chunk sets
``meta.replace_runtime_additional_information``. A section the chunk has replaces
field by field (``codes``, ``meta``: a field left ``None`` keeps the earlier value) or
key by key (``embed``, ``hidden_states``, ``ids``, ``extras``); a scalar (``speaker``,
``language``, ``request_id``) is replaced. Nothing is mutated: every result is new or
shared unchanged, so a runtime info a step already holds never changes under it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from omnirelay.payload.schema import OmniPayload

__all__ = ["merge_runtime_info", "read_codec_chunk"]

_FIELDS = OmniPayload.__struct_fields__
#: Integer dtypes whose ``tolist()`` is a list of ints (no per-element conversion needed).
_INT_DTYPES: frozenset[Any] = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
    | {np.dtype(t) for t in (np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16, np.uint32)}
)


def read_codec_chunk(runtime_info: Any, payload: Any) -> tuple[list[int], OmniPayload | None]:
    """The prompt ids of one committed codec chunk and the request's new runtime info.

    Raises TypeError when ``payload`` is not an OmniPayload or its ``codes.audio`` is
    neither a tensor nor a list.
    """
    if runtime_info is not None and type(runtime_info) is not OmniPayload:
        raise TypeError(f"the runtime info must be an OmniPayload, got {type(runtime_info).__name__}")
    if payload is None:
        return [], runtime_info
    if type(payload) is not OmniPayload:
        raise TypeError(f"a codec chunk must be an OmniPayload, got {type(payload).__name__}")
    prompt: list[int] = []
    codes = payload.codes
    if codes is not None and codes.audio is not None:
        prompt, is_kept = _prompt_of(codes.audio)
        if not is_kept:
            payload = msgspec.structs.replace(payload, codes=msgspec.structs.replace(codes, audio=None))
    meta = payload.meta
    if meta is not None and meta.replace_runtime_additional_information:
        runtime_info = None
    return prompt, merge_runtime_info(runtime_info, payload)


def merge_runtime_info(previous: OmniPayload | None, payload: OmniPayload) -> OmniPayload:
    """``previous`` with ``payload`` merged in (see the module docstring); mutates neither."""
    if previous is None:
        return payload
    merged: dict[str, Any] = {}
    for name in _FIELDS:
        new = getattr(payload, name)
        old = getattr(previous, name)
        if new is None or old is None:
            merged[name] = old if new is None else new
        elif isinstance(new, msgspec.Struct):
            fields = {f: v for f in new.__struct_fields__ if (v := getattr(new, f)) is not None}
            merged[name] = msgspec.structs.replace(old, **fields)
        elif isinstance(new, dict):
            merged[name] = {**old, **new}
        else:
            merged[name] = new
    return OmniPayload(**merged)


def _prompt_of(audio: Any) -> tuple[list[int], bool]:
    """``codes.audio`` → (prompt ids, whether the tensor stays in the runtime info)."""
    if isinstance(audio, list):
        return [int(x) for x in audio], False
    if not isinstance(audio, torch.Tensor | np.ndarray):
        raise TypeError(f"codes.audio must be a tensor or a list, got {type(audio).__name__}")
    if audio.ndim <= 1:
        flat = audio.reshape(-1).tolist()
        if audio.dtype in _INT_DTYPES:
            return flat, False  # tolist gave Python ints already
        return [int(x) for x in flat], False
    size = audio.numel() if isinstance(audio, torch.Tensor) else audio.size
    return ([0] if size else []), True
