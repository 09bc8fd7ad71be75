"""Length of the placeholder prompt a prewarmed Talker gets (docs/protocol.md §2.3).

The orchestrator prewarms a chunk-receiving stage with ``prompt_token_ids = [0] * N``:
the zeros only size positions and KV, they are never synthesized. N follows the
Qwen chat template of the stage-0 prompt:

* turns start at ``<|im_start|>`` (:data:`IM_START_TOKEN_ID`); the role token follows;
* system turns are skipped;
* a user turn counts its whole span, from its ``<|im_start|>`` up to the next one (or the
  end of the prompt);
* if the *last* turn is an assistant turn, :data:`ASSISTANT_TURN_EXTRA` positions are
  added (the Talker's bootstrap rows);
* N = max(1, that sum); a prompt whose last turn start has no role token falls back to
  the prompt length.

A stage may pin N with ``async_chunk_prewarm_prompt_len`` (> 1), passed here as
``override``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = [
    "ASSISTANT_ROLE_TOKEN_ID",
    "ASSISTANT_TURN_EXTRA",
    "IM_START_TOKEN_ID",
    "SYSTEM_ROLE_TOKEN_ID",
    "USER_ROLE_TOKEN_ID",
    "placeholder_prompt_len",
]

#: ``<|im_start|>`` in the Qwen tokenizer.
IM_START_TOKEN_ID = 151644
#: Role token ``system``.
SYSTEM_ROLE_TOKEN_ID = 8948
#: Role token ``user``.
USER_ROLE_TOKEN_ID = 872
#: Role token ``assistant``.
ASSISTANT_ROLE_TOKEN_ID = 77091
#: Positions added when the prompt ends with an (open) assistant turn.
ASSISTANT_TURN_EXTRA = 9


def placeholder_prompt_len(prompt_ids: Sequence[int], override: int | None = None) -> int:
    """N for the placeholder prompt of a prewarmed stage; pure, called once per prewarm.

    ``prompt_ids`` are the stage-0 prompt token ids. ``override`` is the stage's
    ``async_chunk_prewarm_prompt_len``; when given it must be an int > 1 and wins.
    """
    if override is not None:
        if type(override) is not int or override <= 1:
            raise ValueError(f"async_chunk_prewarm_prompt_len must be an int > 1, got {override!r}")
        return override
    ids = [int(t) for t in prompt_ids]
    starts = [i for i, token in enumerate(ids) if token == IM_START_TOKEN_ID]
    if starts and starts[-1] + 1 >= len(ids):
        # The last turn start has no role token: the template was cut; the scan cannot
        # classify that turn, so size by the whole prompt as the reference does.
        return max(1, len(ids))
    total = 0
    bounds = [*starts, len(ids)]
    for turn, (start, end) in enumerate(itertools.pairwise(bounds)):
        role = ids[start + 1]
        if role == USER_ROLE_TOKEN_ID:
            total += end - start
        elif role == ASSISTANT_ROLE_TOKEN_ID and turn == len(starts) - 1:
            total += ASSISTANT_TURN_EXTRA
    return max(1, total)
