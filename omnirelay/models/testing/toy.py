"""Small deterministic executors and processors for tests and benchmarks.

Executors (registered by :func:`register_toys` under these names, as factories called
``factory(**stage.executor_args) -> Executor``, the convention of
:mod:`omnirelay.engine.components`):

* ``toy.counting_lm`` — :class:`CountingLM`, AR: next token = (last + 1) % vocab; each
  step's ``next_stage_output`` is a 1-D int64 tensor of the step's new token(s).
* ``toy.relay_lm`` — :class:`RelayLM`, AR, chunk-receiving: one token per row of the
  received chunk (``codes.audio``), ``(row * multiplier + offset) % vocab``; finishes on
  the upstream's terminal chunk; forwards its tokens the same way.
* ``toy.sample_generator`` — :class:`SampleGenerator`, generation: every input code *c*
  becomes ``samples_per_code`` float32 samples ``c + j / samples_per_code``; a received
  chunk's 1-D codes are its prompt (``read_chunk``: the codec chunk reader).

Processor (``toy.forward_chunk``, :func:`forward_chunk`): a step's output as the payload
``OmniPayload(codes=Codes(audio=output))`` — an AR receiver reads the rows from it, a
generation receiver takes the 1-D codes as its prompt.

Every executor counts its calls and batch sizes and keeps the set of internal ids it
holds state for (dropped in ``release``), exposed by ``leak_state()``. ``step_s`` gives
every step a fixed duration whatever its batch (the step sleeps: a stand-in for an
accelerator's step, which takes time but no CPU), so a stage can be made the bottleneck.

:func:`toy_pipeline_config` builds the three-stage toy pipeline
``counter (AR) -> relay (AR) -> synth (generation)`` with chunked edges.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.payload.schema import Codes, OmniPayload
from omnirelay.pipeline.config import PipelineConfig, StageConfig
from omnirelay.pipeline.parse import parse_pipeline
from omnirelay.pipeline.registry import ComponentRegistry
from omnirelay.processors.codec_input import read_codec_chunk
from omnirelay.transfer import BuildRequest

__all__ = [
    "TOY_SAMPLE_RATE",
    "CountingLM",
    "RelayLM",
    "SampleGenerator",
    "ToyExecutor",
    "default_registry",
    "expected_counting_tokens",
    "expected_relay_tokens",
    "expected_waveform",
    "forward_chunk",
    "register_toys",
    "toy_pipeline_config",
    "toy_registry",
]

TOY_SAMPLE_RATE = 24_000


class ToyExecutor:
    """Call accounting and per-request state shared by the toy executors."""

    execution_type = "ar"

    def __init__(self, *, supports_batching: bool = True, step_s: float = 0.0) -> None:
        if not (isinstance(step_s, int | float) and not isinstance(step_s, bool) and 0 <= step_s <= 60):
            raise ValueError(f"step_s must be seconds in 0..60, got {step_s!r}")
        self.supports_batching = supports_batching
        self.step_s = float(step_s)
        self.num_calls = 0
        self.num_items = 0
        self.max_batch_size = 0
        self.batch_sizes: dict[int, int] = {}  # batch size -> number of calls
        self.live: set[str] = set()
        self.num_released = 0

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        assert batch, "an executor step needs at least one item"
        assert self.supports_batching or len(batch) == 1, f"batch of {len(batch)} to a non-batching executor"
        self.num_calls += 1
        self.num_items += len(batch)
        self.max_batch_size = max(self.max_batch_size, len(batch))
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        if self.step_s:
            time.sleep(self.step_s)  # a fixed cost per step, whatever the batch
        out = []
        for item in batch:
            self.live.add(item.internal_id)
            out.append(self.step_one(item))
        return out

    def step_one(self, item: BatchItem) -> ItemResult:
        raise NotImplementedError

    def release(self, internal_id: str) -> None:
        if internal_id in self.live:
            self.live.discard(internal_id)
            self.num_released += 1

    def leak_state(self) -> dict[str, Any]:
        return {"live": sorted(self.live)} if self.live else {}


class CountingLM(ToyExecutor):
    """AR: next token = (last + 1) % vocab_size; ``eos_token_id`` ends the request."""

    execution_type = "ar"

    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        supports_batching: bool = True,
        step_s: float = 0.0,
    ) -> None:
        super().__init__(supports_batching=supports_batching, step_s=step_s)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def step_one(self, item: BatchItem) -> ItemResult:
        last = item.all_token_ids[-1] if item.all_token_ids else 0
        token = (last + 1) % self.vocab_size
        return ItemResult(
            internal_id=item.internal_id,
            token_ids=[token],
            finished=token == self.eos_token_id,
            next_stage_output=torch.tensor([token], dtype=torch.int64),
        )


class RelayLM(ToyExecutor):
    """AR receiver: one token per received row; done at the upstream's terminal chunk."""

    execution_type = "ar"

    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        multiplier: int = 2,
        offset: int = 1,
        supports_batching: bool = True,
        step_s: float = 0.0,
    ) -> None:
        super().__init__(supports_batching=supports_batching, step_s=step_s)
        self.vocab_size = vocab_size
        self.multiplier = multiplier
        self.offset = offset

    def step_one(self, item: BatchItem) -> ItemResult:
        payload = item.additional_information
        rows: list[int] = []
        if payload is not None:
            if type(payload) is not OmniPayload:
                raise TypeError(f"RelayLM reads OmniPayload chunks, got {type(payload).__name__}")
            if payload.codes is not None and payload.codes.audio is not None:
                rows = [int(x) for x in torch.as_tensor(payload.codes.audio).reshape(-1).tolist()]
        # No chunk attached: the upstream is exhausted (it decodes on its own).
        finished = payload is None or item.is_upstream_exhausted
        tokens = [(r * self.multiplier + self.offset) % self.vocab_size for r in rows]
        return ItemResult(
            internal_id=item.internal_id,
            token_ids=tokens,
            finished=finished,
            next_stage_output=torch.tensor(tokens, dtype=torch.int64) if tokens else None,
        )


class SampleGenerator(ToyExecutor):
    """Generation: each code c -> ``samples_per_code`` samples ``c + j / samples_per_code``."""

    execution_type = "generation"
    #: A received chunk's 1-D codes are the prompt (docs/protocol.md §4.8).
    read_chunk = staticmethod(read_codec_chunk)

    def __init__(
        self,
        *,
        samples_per_code: int = 4,
        sample_rate: int = TOY_SAMPLE_RATE,
        supports_batching: bool = True,
        step_s: float = 0.0,
    ) -> None:
        super().__init__(supports_batching=supports_batching, step_s=step_s)
        self.samples_per_code = samples_per_code
        self.sample_rate = sample_rate

    def step_one(self, item: BatchItem) -> ItemResult:
        return ItemResult(
            internal_id=item.internal_id,
            audio=expected_waveform(item.input_token_ids, self.samples_per_code),
            sample_rate=self.sample_rate,
        )


def forward_chunk(request: BuildRequest) -> OmniPayload | None:
    """The toy chunk processor: the step's output as ``codes.audio`` (None: nothing)."""
    if request.output is None:
        return None
    return OmniPayload(codes=Codes(audio=request.output))


# --------------------------------------------------------------------------- expectations


def expected_counting_tokens(prompt: Sequence[int], max_tokens: int, vocab_size: int = 1000) -> list[int]:
    last = prompt[-1] if prompt else 0
    return [(last + i) % vocab_size for i in range(1, max_tokens + 1)]


def expected_relay_tokens(
    upstream: Sequence[int], vocab_size: int = 1000, multiplier: int = 2, offset: int = 1
) -> list[int]:
    return [(t * multiplier + offset) % vocab_size for t in upstream]


def expected_waveform(codes: Sequence[int], samples_per_code: int = 4) -> torch.Tensor:
    c = torch.as_tensor(list(codes), dtype=torch.float32)
    frac = torch.arange(samples_per_code, dtype=torch.float32) / samples_per_code
    return (c[:, None] + frac[None, :]).reshape(-1)


# --------------------------------------------------------------------------- registry


def _factory(cls: type[ToyExecutor]) -> Any:
    def make(**executor_args: Any) -> ToyExecutor:
        return cls(**executor_args)

    make.__name__ = f"make_{cls.__name__}"
    return make


def _forward_factory(stage: StageConfig, pipeline: PipelineConfig) -> Any:
    return forward_chunk


def register_toys(registry: ComponentRegistry) -> ComponentRegistry:
    """Register the toy executors and processor (see the module docstring)."""
    registry.executors.add("toy.counting_lm", _factory(CountingLM))
    registry.executors.add("toy.relay_lm", _factory(RelayLM))
    registry.executors.add("toy.sample_generator", _factory(SampleGenerator))
    registry.processors.add("toy.forward_chunk", _forward_factory)
    return registry


def toy_registry() -> ComponentRegistry:
    """A new registry holding the toys only."""
    return register_toys(ComponentRegistry())


#: The name the process layer's default engine factory looks up.
default_registry = toy_registry


def toy_pipeline_config(
    *,
    backend: str = "inproc",
    namespace: str | None = None,
    async_chunk: bool = True,
    max_num_seqs: int = 64,
    counter_max_tokens: int = 16,
    relay_max_tokens: int = 256,
    samples_per_code: int = 4,
    supports_batching: bool = True,
    input_wait_timeout_s: float = 600.0,
    replicas: Mapping[int, int] | None = None,
    step_s: Mapping[int, float] | None = None,
    stage_max_num_seqs: Mapping[int, int] | None = None,
) -> PipelineConfig:
    """``counter (AR, text) -> relay (AR) -> synth (generation, audio)``, chunked edges.

    Per stage id: ``replicas`` (worker processes), ``step_s`` (a fixed step duration,
    see the module docstring) and ``stage_max_num_seqs`` (over ``max_num_seqs``)."""
    batching = {"supports_batching": supports_batching}
    data: dict[str, Any] = {
        "name": "toy-relay",
        "description": "deterministic toy pipeline for engine tests and benchmarks",
        "async_chunk": async_chunk,
        "input_wait_timeout_s": input_wait_timeout_s,
        "connectors": {"toy": {"backend": backend}},
        "default_connector": "toy",
        "stages": [
            {
                "id": 0,
                "name": "counter",
                "execution_type": "ar",
                "executor": "toy.counting_lm",
                "executor_args": dict(batching),
                "final_output": True,
                "final_output_type": "text",
                "chunk_processor": "toy.forward_chunk",
                "max_num_seqs": max_num_seqs,
                "sampling": {"max_tokens": counter_max_tokens},
            },
            {
                "id": 1,
                "name": "relay",
                "execution_type": "ar",
                "executor": "toy.relay_lm",
                "executor_args": dict(batching),
                "input_sources": [0],
                "chunk_processor": "toy.forward_chunk",
                "max_num_seqs": max_num_seqs,
                "sampling": {"max_tokens": relay_max_tokens},
            },
            {
                "id": 2,
                "name": "synth",
                "execution_type": "generation",
                "executor": "toy.sample_generator",
                "executor_args": {"samples_per_code": samples_per_code, **batching},
                "input_sources": [1],
                "final_output": True,
                "final_output_type": "audio",
                "max_num_seqs": max_num_seqs,
                "async_scheduling": False,
            },
        ],
    }
    if namespace is not None:
        data["namespace"] = namespace
    for sid, stage in enumerate(data["stages"]):
        if replicas and sid in replicas:
            stage["replicas"] = replicas[sid]
        if step_s and sid in step_s:
            stage["executor_args"] = {**stage["executor_args"], "step_s": step_s[sid]}
        if stage_max_num_seqs and sid in stage_max_num_seqs:
            stage["max_num_seqs"] = stage_max_num_seqs[sid]
    return parse_pipeline(data, source="<toy>", registry=toy_registry())
