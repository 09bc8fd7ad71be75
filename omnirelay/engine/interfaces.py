"""The contracts between a stage engine, its executor and the process layer.

Three parties, three surfaces (everything here is plain data):

* **Executor** (``omnirelay.models`` or the toy executors): runs one batched step of a
  model. ``Executor.step(batch) -> list[ItemResult]``. It owns per-request model state
  (KV caches) keyed by internal id and frees it in ``release``. A generation executor
  that receives chunks also says what it makes of one: ``read_chunk``, a
  :data:`ChunkReader`.
* **StageEngine** (``omnirelay.engine``): one stage in one process — scheduler + executor
  + transfer adapter. Driven by the worker loop through :class:`StageEngineProtocol`:
  ``add_request``, ``abort``, ``release``, ``step() -> list[StageOutput]``,
  ``take_released() -> list[str]``, ``has_work()``, ``wait_for_work(timeout)``, …
* **Control plane** (``omnirelay.worker`` and ``omnirelay.orchestrator``): moves
  :class:`StageRequest` from the front process to a stage worker and :class:`StageOutput`
  (and the completed releases) back. Tensors never travel
  on it except the final client-visible outputs (text ids, audio), encoded with the
  payload codec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

__all__ = [
    "BatchItem",
    "ChunkReader",
    "Executor",
    "ItemResult",
    "PendingStep",
    "SamplingParams",
    "StageEngineProtocol",
    "StageOutput",
    "StageRequest",
]


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()


class StageRequest(msgspec.Struct, kw_only=True):
    """What the orchestrator submits to one stage for one request."""

    request_id: str  # external id (whole pipeline)
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    is_placeholder: bool = False  # a prewarm placeholder of a chunk-receiving stage
    #: full input forwarded from the previous stage (non-chunk edge), payload-codec encodable
    inputs: Any = None
    #: the highest stage this request needs; a stage >= final_stage_id sends no chunks
    final_stage_id: int = 0
    stream: bool = True
    extras: dict[str, Any] = {}
    #: the replica of the next stage the request is bound to: where this stage's chunks
    #: of it are announced (docs/design.md §11); 0 when the next stage has one
    send_to_replica: int = 0


class StageOutput(msgspec.Struct, kw_only=True):
    """What a stage reports for one request after a step (client-visible part only)."""

    request_id: str  # external id
    stage_id: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    token_ids: list[int] = []  # new token ids this step (AR stages)
    text: str | None = None  # new text this step, if the executor detokenizes
    audio: Any = None  # new waveform samples this step (1-D float32 tensor), generation stages
    sample_rate: int | None = None
    error: str | None = None
    #: a final output's counts and latencies at this stage (``engine/stage_output.py``);
    #: an engine's step tracer may add its own keys (``engine/tracing.py``)
    metrics: dict[str, float] = {}


class BatchItem(msgspec.Struct, kw_only=True):
    """One request's share of a batched executor step."""

    internal_id: str
    external_id: str
    #: token ids to compute this step: the (rest of the) prompt on prefill, else the last token
    input_token_ids: list[int]
    #: all tokens so far (prompt + output), for executors that need the context
    all_token_ids: list[int]
    num_computed_tokens: int
    is_prefill: bool
    sampling: SamplingParams
    #: what the upstream chunks committed for this step, as the stage reads them: an AR
    #: stage gets the chunk's payload as the upstream processor built it (a Talker: a
    #: Thinker → Talker ``OmniPayload``); a generation stage the runtime info its
    #: :data:`ChunkReader` made (Code2Wav: the merged codec ``OmniPayload``)
    additional_information: Any = None
    #: a full input forwarded by the orchestrator (non-chunk edge)
    inputs: Any = None
    #: a chunk-receiving request whose upstream's last chunk is committed (this step's or
    #: an earlier one): no more input will come
    is_upstream_exhausted: bool = False


class ItemResult(msgspec.Struct, kw_only=True):
    """The executor's result for one :class:`BatchItem`."""

    internal_id: str
    #: sampled token ids (AR: normally one per step); empty for generation stages
    token_ids: list[int] = []
    #: the executor decided the request is done (EOS, codec stop) — the scheduler also
    #: applies max_tokens and stop_token_ids
    finished: bool = False
    #: client-visible output of this step (text, audio samples)
    text: str | None = None
    audio: Any = None
    sample_rate: int | None = None
    #: what the next stage's processor consumes (hidden states, codec frame …); handed to
    #: ``TransferAdapter.save_async(output=...)``; None = nothing for downstream this step
    next_stage_output: Any = None
    #: the step computed a piece of a prompt that is split across steps (a stage's
    #: ``max_prefill_piece_tokens``, docs/design.md §12) and the prompt is not complete:
    #: nothing is sampled, nothing is emitted (``token_ids`` empty, ``text``, ``audio`` and
    #: ``next_stage_output`` None); the executor keeps what the later pieces need
    is_partial_prefill: bool = False


#: How a chunk-receiving generation stage reads one committed chunk (docs/protocol.md
#: §4.8): ``read_chunk(runtime_info, payload) -> (prompt_token_ids, runtime_info)``.
#: ``runtime_info`` is what the request's earlier chunks left (``None`` before the first),
#: ``payload`` the chunk's body (``None``: a boundary with nothing new). The prompt is what
#: the step computes (a fresh one-shot prefill); the new runtime info goes to the step
#: (``BatchItem.additional_information``) and to the next chunk's call. Called on the
#: engine thread, once per committed chunk; pure. Raises ``TypeError`` or ``ValueError``
#: when the payload breaks the stage's contract (the request then fails with the reason).
ChunkReader = Callable[[Any, Any], tuple[list[int], Any]]


@runtime_checkable
class Executor(Protocol):
    execution_type: str  # "ar" | "generation"
    supports_batching: bool

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        """Run one step for every item; results in the same order. Called on the stage's
        engine thread only."""
        ...

    def release(self, internal_id: str) -> None:
        """Free the request's model state (KV cache …). Idempotent."""
        ...

    # Optional: ``launch(batch) -> PendingStep`` — the step split in two (a device
    # group's loop overlaps stages with it, docs/design.md §12): enqueue the step's work
    # (kernels, a graph replay on the stage's own CUDA stream, an event recorded after
    # it, results copied non-blocking into pinned host buffers) and return at once; the
    # engine polls ``is_done()`` and takes ``result()`` once it is. Without it, the engine
    # calls ``step`` (the step is done when it returns).

    # Optional: ``supports_prefill_pieces = True`` — the executor (AR) takes a prompt in
    # pieces over several steps (``BatchItem.input_token_ids`` a slice starting at
    # ``num_computed_tokens``) and answers a piece that is not the last with
    # ``ItemResult(is_partial_prefill=True)``; a stage's ``max_prefill_piece_tokens`` needs it.

    # Optional: ``keep_outputs_on_device(enabled: bool)`` — called once, before the first
    # step, when the stage's edge to the next one is GPU-direct (docs/protocol.md §3.9):
    # hand next_stage_output's tensors on the model's device instead of copying them to
    # the host (the Thinker does).


class PendingStep(Protocol):
    """A launched executor step (``Executor.launch``)."""

    def is_done(self) -> bool:
        """Has the step's work ended (its event completed)? Never blocks."""
        ...

    def result(self) -> list[ItemResult]:
        """The step's results, in batch order (raises what the step raised). Called
        once, normally after ``is_done()`` said True; before, it waits."""
        ...


class StageEngineProtocol(Protocol):
    """What the worker loop drives; one engine thread calls everything but the commands.

    ``add_request`` / ``abort`` / ``release`` may also be called from other threads; an
    engine may apply them at its next ``step``. An optional ``wake()`` ends a
    ``wait_for_work`` early (the worker calls it when a control message arrives); without
    it, the worker waits for control messages itself.
    """

    stage_id: int

    def add_request(self, request: StageRequest) -> None:
        """Take a request; a refusal is an error output of a later ``step``, or raises."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request; its final output says ``finish_reason="abort"``."""
        ...

    def release(self, request_id: str) -> None:
        """No stage needs the request any more: drop every transfer object it still owns
        (``cleanup_prefix``) and any request state, silently (idempotent). Complete once
        ``take_released`` has handed the id out."""
        ...

    def step(self) -> list[StageOutput]:
        """Apply commands and run one tick; the outputs of this tick."""
        ...

    def take_released(self) -> list[str]:
        """The ids whose release completed since the last call, each once: the stage holds
        nothing of them any more and will create nothing under them. Called after every
        ``step``; an engine that completes a release at once hands it out at once."""
        ...

    def num_requests(self) -> int:
        """Requests the engine holds (taken, not yet finished, aborted or released)."""
        ...

    def has_work(self) -> bool:
        """Would ``step`` do anything now?"""
        ...

    def wait_for_work(self, timeout: float) -> bool:
        """Block until there is work or ``timeout`` passed; True if there is work."""
        ...

    def health(self) -> dict[str, Any]: ...

    def leak_state(self) -> dict[str, Any]:
        """Every non-empty per-request container (``{}`` when none is left)."""
        ...

    def shutdown(self) -> None: ...
