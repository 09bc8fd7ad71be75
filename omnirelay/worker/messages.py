"""Every message of the control plane between the front process and a stage worker.

Typed ``msgspec`` structs, tagged (``{"type": "submit", ...}``) so that one decoder per
direction reads a union (docs/design.md §2, docs/design.md §7):

* front → worker (:data:`ToWorker`): :class:`Submit`, :class:`Abort`, :class:`Release`,
  :class:`HealthRequest`, :class:`LeakStateRequest`, :class:`Shutdown`;
* worker → front (:data:`ToFront`): :class:`Hello`, :class:`StartupFailed`,
  :class:`Outputs`, :class:`RequestFailed`, :class:`Released`, :class:`StageFatal`, :class:`HealthReply`,
  :class:`LeakStateReply`, :class:`Goodbye`.

Tensors never travel as msgpack: the fields that may hold them (a request's forwarded
``inputs`` and ``extras``, an output's ``audio``) cross as payload-codec bytes
(:mod:`omnirelay.payload.codec`). :func:`wire_request` / :func:`stage_request` and
:func:`wire_output` / :func:`stage_output` convert between the engine contract
(:mod:`omnirelay.engine.interfaces`) and these wire forms.

Free-form dicts a worker reports (engine health, leak state) are encoded with a hook
that turns anything msgpack cannot say into its ``repr``: a report is for reading, and
one odd value must not lose the whole reply.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnirelay.engine.interfaces import SamplingParams, StageOutput, StageRequest
from omnirelay.errors import PipelineError
from omnirelay.payload import codec

__all__ = [
    "Abort",
    "Goodbye",
    "HealthReply",
    "HealthRequest",
    "Hello",
    "LeakStateReply",
    "LeakStateRequest",
    "Outputs",
    "Release",
    "Released",
    "RequestFailed",
    "Shutdown",
    "StageFatal",
    "StartupFailed",
    "Submit",
    "ToFront",
    "ToWorker",
    "WireOutput",
    "WireRequest",
    "decode_to_front",
    "decode_to_worker",
    "encode_message",
    "stage_output",
    "stage_request",
    "wire_output",
    "wire_request",
]


# --------------------------------------------------------------------- wire forms


class WireRequest(msgspec.Struct, kw_only=True, frozen=True):
    """:class:`StageRequest` on the wire; ``inputs`` and ``extras`` are codec bytes."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    is_placeholder: bool = False
    inputs: bytes | None = None
    final_stage_id: int = 0
    stream: bool = True
    extras: bytes | None = None
    send_to_replica: int = 0


class WireOutput(msgspec.Struct, kw_only=True, frozen=True):
    """:class:`StageOutput` on the wire; ``audio`` is codec bytes."""

    request_id: str
    stage_id: int
    finished: bool = False
    finish_reason: str | None = None
    token_ids: list[int] = []
    text: str | None = None
    audio: bytes | None = None
    sample_rate: int | None = None
    error: str | None = None
    metrics: dict[str, float] = {}


def wire_request(request: StageRequest) -> WireRequest:
    """Encode one request for the control plane (tensors in ``inputs``/``extras`` via the codec)."""
    return WireRequest(
        request_id=request.request_id,
        prompt_token_ids=[int(t) for t in request.prompt_token_ids],
        sampling=request.sampling,
        is_placeholder=request.is_placeholder,
        inputs=None if request.inputs is None else codec.encode(request.inputs),
        final_stage_id=request.final_stage_id,
        stream=request.stream,
        extras=codec.encode(request.extras) if request.extras else None,
        send_to_replica=request.send_to_replica,
    )


def stage_request(wire: WireRequest) -> StageRequest:
    """Decode a :class:`WireRequest` back into the engine's :class:`StageRequest`."""
    return StageRequest(
        request_id=wire.request_id,
        prompt_token_ids=list(wire.prompt_token_ids),
        sampling=wire.sampling,
        is_placeholder=wire.is_placeholder,
        inputs=None if wire.inputs is None else codec.decode(wire.inputs),
        final_stage_id=wire.final_stage_id,
        stream=wire.stream,
        extras={} if wire.extras is None else dict(codec.decode(wire.extras)),
        send_to_replica=wire.send_to_replica,
    )


def wire_output(output: StageOutput) -> WireOutput:
    """Encode one stage output (the audio tensor via the payload codec)."""
    return WireOutput(
        request_id=output.request_id,
        stage_id=output.stage_id,
        finished=output.finished,
        finish_reason=output.finish_reason,
        token_ids=[int(t) for t in output.token_ids],
        text=output.text,
        audio=None if output.audio is None else codec.encode(output.audio),
        sample_rate=output.sample_rate,
        error=output.error,
        metrics={str(k): float(v) for k, v in output.metrics.items()},
    )


def stage_output(wire: WireOutput) -> StageOutput:
    """Decode a :class:`WireOutput` back into a :class:`StageOutput`."""
    return StageOutput(
        request_id=wire.request_id,
        stage_id=wire.stage_id,
        finished=wire.finished,
        finish_reason=wire.finish_reason,
        token_ids=list(wire.token_ids),
        text=wire.text,
        audio=None if wire.audio is None else codec.decode(wire.audio),
        sample_rate=wire.sample_rate,
        error=wire.error,
        metrics=dict(wire.metrics),
    )


# ------------------------------------------------------------------ front → worker


class Submit(msgspec.Struct, tag="submit", frozen=True):
    """Add a request to the stage's engine."""

    request: WireRequest


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Abort the request in this stage (idempotent; unknown ids are ignored)."""

    request_id: str


class Release(msgspec.Struct, tag="release", frozen=True):
    """No stage needs the request any more: drop its transfer objects and state (docs/protocol.md §2.8)."""

    request_id: str


class HealthRequest(msgspec.Struct, tag="health", frozen=True):
    seq: int


class LeakStateRequest(msgspec.Struct, tag="leak_state", frozen=True):
    """Ask for the worker's and the engine's per-request books (leak audits), once
    in-flight cleanup settled or ``settle_s`` passed."""

    seq: int
    settle_s: float = 0.0


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Shut the engine down, close everything, exit."""


ToWorker = Submit | Abort | Release | HealthRequest | LeakStateRequest | Shutdown


# ------------------------------------------------------------------ worker → front


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """The worker built its engine and serves requests: which replica of its stage it is,
    and how many requests it runs at once (what the front's routing weighs its load by)."""

    stage_id: int
    pid: int
    replica: int = 0
    capacity: int = 0


class StartupFailed(msgspec.Struct, tag="startup_failed", frozen=True):
    """Building the engine failed; the worker exits after sending this."""

    stage_id: int
    pid: int
    error: str


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    """The outputs of one engine step."""

    stage_id: int
    outputs: list[WireOutput]


class RequestFailed(msgspec.Struct, tag="request_failed", frozen=True):
    """One request could not be handled by this stage (for example ``add_request`` raised)."""

    stage_id: int
    request_id: str
    error: str


class StageFatal(msgspec.Struct, tag="stage_fatal", frozen=True):
    """The engine broke (``step`` raised); the worker exits after sending this."""

    stage_id: int
    error: str


class HealthReply(msgspec.Struct, tag="health_reply", frozen=True):
    seq: int
    stage_id: int
    pid: int
    #: requests the worker handed to its engine and has not seen finish, abort or release
    num_requests: int
    engine: dict[str, Any]


class LeakStateReply(msgspec.Struct, tag="leak_state_reply", frozen=True):
    seq: int
    stage_id: int
    #: ``{"worker": {...}, "engine": engine.leak_state()}``
    state: dict[str, Any]


class Released(msgspec.Struct, tag="released", frozen=True):
    """The worker applied a :class:`Release`: everything it says about the id after this
    belongs to a new request with the same id (the front's fence against id reuse)."""

    stage_id: int
    request_id: str


class Goodbye(msgspec.Struct, tag="goodbye", frozen=True):
    """Sent after a clean shutdown, right before the worker exits."""

    stage_id: int


ToFront = (
    Hello
    | StartupFailed
    | Outputs
    | RequestFailed
    | Released
    | StageFatal
    | HealthReply
    | LeakStateReply
    | Goodbye
)


# ------------------------------------------------------------------------ codecs


def _enc_hook(obj: Any) -> Any:
    # Only free-form report dicts reach this hook: the typed fields are plain already.
    if hasattr(obj, "tolist"):  # a numpy / torch scalar or small array in a report
        try:
            return obj.tolist()
        except Exception:  # a value we cannot turn into data: show it instead
            return repr(obj)
    return repr(obj)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
_TO_FRONT = msgspec.msgpack.Decoder(ToFront)


def encode_message(message: ToWorker | ToFront) -> bytes:
    """One message → bytes (one zmq frame)."""
    return _ENCODER.encode(message)


def decode_to_worker(data: bytes) -> ToWorker:
    """Bytes from the front → a message; :class:`PipelineError` on anything else."""
    try:
        return _TO_WORKER.decode(data)
    except msgspec.DecodeError as exc:
        raise PipelineError(f"bad control message for a stage worker: {exc}") from exc


def decode_to_front(data: bytes) -> ToFront:
    """Bytes from a worker → a message; :class:`PipelineError` on anything else."""
    try:
        return _TO_FRONT.decode(data)
    except msgspec.DecodeError as exc:
        raise PipelineError(f"bad control message from a stage worker: {exc}") from exc
