"""The omnirelay exception hierarchy.

Every error omnirelay raises on purpose is an :class:`OmniRelayError`. Foreign
exceptions (``OSError``, ``msgspec.DecodeError``, ``yaml.YAMLError`` …) are
translated at layer boundaries with ``raise X(...) from exc`` and never logged
and dropped.

::

    OmniRelayError
    ├── ConfigError                 bad user configuration (YAML, CLI flags, options)
    │   └── PipelineConfigError     a pipeline file that does not validate (names file/stage/key)
    ├── PayloadError                the payload layer
    │   ├── PayloadEncodeError      an object that cannot be put on the wire (unsupported type…)
    │   └── PayloadDecodeError      bytes that are not a valid payload
    │       ├── PayloadTruncatedError   fewer bytes than the header promises
    │       ├── PayloadMagicError       not an omnirelay payload at all
    │       ├── PayloadVersionError     a wire version this build does not read
    │       └── PayloadSchemaError      a field the schema does not know, or of the wrong type
    ├── ConnectorError              the connector layer (raised only where the contract allows:
    │   │                           put/get report transport trouble as values, not exceptions)
    │   └── InvalidKeyError         a transfer key that cannot be used (empty, too long)
    ├── TransferError               the chunk transfer adapter used wrongly (closed, no such edge);
    │                               a request's transfer failure is data, not an exception: a
    │                               TransferFailure with its FailureKind (omnirelay.transfer)
    ├── PipelineError               the runtime (engine, orchestrator, workers)
    │   ├── StageDiedError          a stage worker process exited
    │   ├── RequestFailedError      a request failed; carries the reason
    │   │   └── StageUnavailableError   a stage it needs is down (restarting or given up on)
    │   └── InvalidRequestError     a client's request is malformed (also a ValueError)
    └── ModelError                  loading or running a model
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ConnectorError",
    "InvalidKeyError",
    "InvalidRequestError",
    "ModelError",
    "OmniRelayError",
    "PayloadDecodeError",
    "PayloadEncodeError",
    "PayloadError",
    "PayloadMagicError",
    "PayloadSchemaError",
    "PayloadTruncatedError",
    "PayloadVersionError",
    "PipelineConfigError",
    "PipelineError",
    "RequestFailedError",
    "StageDiedError",
    "StageUnavailableError",
    "TransferError",
]


class OmniRelayError(Exception):
    """Base class of every error omnirelay raises on purpose."""


class ConfigError(OmniRelayError):
    """A configuration value is wrong; the message says which and how to fix it."""


class PipelineConfigError(ConfigError):
    """A pipeline file does not validate. The message names the file, the stage and the key."""


class PayloadError(OmniRelayError):
    """Base of payload schema and wire codec errors."""


class PayloadEncodeError(PayloadError):
    """The object cannot be encoded (unsupported type, object dtype, too large…)."""


class PayloadDecodeError(PayloadError):
    """The bytes are not a valid omnirelay payload."""


class PayloadTruncatedError(PayloadDecodeError):
    """The buffer is shorter than its header says."""


class PayloadMagicError(PayloadDecodeError):
    """The buffer does not start with the omnirelay payload magic."""


class PayloadVersionError(PayloadDecodeError):
    """The buffer was written by a wire version this build cannot read."""


class PayloadSchemaError(PayloadDecodeError):
    """A struct field is unknown or has the wrong type."""


class ConnectorError(OmniRelayError):
    """Base of connector-layer errors."""


class InvalidKeyError(ConnectorError):
    """A transfer key is empty, too long or otherwise unusable."""


class TransferError(OmniRelayError):
    """Base of chunk transfer adapter errors."""


class PipelineError(OmniRelayError):
    """Base of runtime errors (engine, orchestrator, workers)."""


class StageDiedError(PipelineError):
    """A stage worker process exited while requests were in flight."""


class RequestFailedError(PipelineError):
    """A request failed; ``reason`` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class StageUnavailableError(RequestFailedError):
    """A stage the request needs is down: its process died (the request was failed at
    once) or is being restarted, or the orchestrator gave up restarting it.

    ``retry_after_s``: when the stage is expected back (None: it is not coming back
    without a restart of the whole pipeline). Servers answer it with 503 and
    ``Retry-After``; the code clients see is :attr:`code`.
    """

    code = "stage_unavailable"

    def __init__(self, request_id: str, reason: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(request_id, reason)
        self.retry_after_s = retry_after_s


class InvalidRequestError(PipelineError, ValueError):
    """A request a client submitted is malformed (bad id, prompt, modalities, sampling);
    the message says what was wrong and how to fix it. Nothing was started."""


class ModelError(OmniRelayError):
    """A model could not be loaded or run."""
