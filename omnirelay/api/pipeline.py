"""The Python API: start a pipeline, submit requests, stream their outputs, shut down.

::

    from omnirelay import Pipeline

    with Pipeline.start("toy-3stage") as pipe:                 # one worker process per stage
        handle = pipe.submit([1, 2, 3], modalities=["text", "audio"])
        for out in handle:                                     # or: async for out in handle
            print(out.stage_id, out.modality, out.token_ids, out.audio)
        print(pipe.health())
    # shut down: no processes, no /dev/shm objects left

:class:`Pipeline` runs the front-side :class:`~omnirelay.orchestrator.Orchestrator` on
an asyncio event loop in a thread of its own, so the API works the same from plain
threads and from any event loop (a server's): ``submit`` and ``abort`` never block;
``health``/``leak_state``/``shutdown`` block (their ``*_async`` forms await).

Request ids are untrusted input: a str of 1–256 characters without control characters
(:func:`validate_request_id`); anything else is an :class:`InvalidRequestError` that
says so, and nothing is started.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import itertools
import os
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from omnirelay.api.options import PipelineOptions, RuntimeHooks
from omnirelay.connectors import reclaim_namespace
from omnirelay.connectors.base import validate_namespace
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.engine.step_recorder import StepRecorder
from omnirelay.errors import (
    ConfigError,
    InvalidKeyError,
    InvalidRequestError,
    PipelineError,
    StageUnavailableError,
)
from omnirelay.ids import MAX_REQUEST_ID_LEN, request_id_problem
from omnirelay.models.family import Announce, PromptSide, quiet
from omnirelay.orchestrator.handle import RequestHandle, RequestResult
from omnirelay.orchestrator.orchestrator import Orchestrator
from omnirelay.orchestrator.requests import PipelineRequest, requested_modalities
from omnirelay.orchestrator.router import Router
from omnirelay.orchestrator.stage_processes import PipelineHealth, ShutdownReport
from omnirelay.pipeline import NO_RESTARTS, ComponentRegistry, PipelineConfig, RestartPolicy, load_pipeline
from omnirelay.worker import DEFAULT_ENGINE_FACTORY, leak_paths

__all__ = [
    "MAX_REQUEST_ID_LEN",
    "NO_RESTARTS",
    "Pipeline",
    "RestartPolicy",
    "chat_tokenizer",
    "prompt_side",
    "validate_request_id",
]


T = TypeVar("T")
_NAMESPACE_COUNTER = itertools.count()


def validate_request_id(request_id: object) -> str:
    """Return ``request_id`` if it is usable, else raise :class:`InvalidRequestError`.

    The rules are :func:`omnirelay.ids.request_id_problem`'s: a ``str`` of 1–256
    characters, none of them a control character or a lone surrogate.
    """
    problem = request_id_problem(request_id)
    if problem is not None:
        raise InvalidRequestError(problem)
    assert isinstance(request_id, str)
    return request_id


def _off_stages(config: PipelineConfig, opts: PipelineOptions) -> frozenset[int]:
    """The stages not to start: the audio entry stage when audio input is off."""
    entry = config.audio_entry_stage_id
    return frozenset() if opts.audio_input or entry is None else frozenset({entry})


#: The longest session key a request may carry.
MAX_SESSION_CHARS = 256


def _validate_session(session: object) -> str | None:
    if session is None:
        return None
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS:
        raise InvalidRequestError(
            f"session must be a non-empty str of at most {MAX_SESSION_CHARS} characters, got {session!r:.80}"
        )
    return session


def _validate_prompt(prompt_token_ids: object) -> list[int] | None:
    if prompt_token_ids is None:
        return None
    if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
        raise InvalidRequestError(
            f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}"
            " (pass text= for a text prompt)"
        )
    ids = list(prompt_token_ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidRequestError(f"prompt_token_ids[{i}] must be an int >= 0, got {t!r}")
    return ids


def chat_tokenizer(
    pipeline: str | os.PathLike[str] | PipelineConfig, *, system: str | None = None
) -> Callable[[str], list[int]]:
    """A ``text -> prompt token ids`` function for ``Pipeline.start(..., tokenizer=...)``.

    It is the prompt stage's tokenizer (stage 0, or stage 1 behind a speech recognizer)
    with its chat layout: ``text`` becomes one user turn (after
    ``system``, if given) and the open assistant turn (the Qwen ChatML layout the
    Qwen3-Omni Thinker and Talker expect, or SmolLM2's own template). The tokenizer is
    loaded now, in this process; what it needs on first use (the tiny Qwen3-Omni, SmolLM2's
    converted checkpoint) is made first and cached. Raises :class:`ConfigError` when that
    stage is not a text model.
    """
    config = pipeline if isinstance(pipeline, PipelineConfig) else load_pipeline(pipeline)
    prompts = prompt_side(config)
    if prompts is None:
        stage = config.stages[config.prompt_stage_id]
        raise ConfigError(
            f"{stage.label} of pipeline {config.name!r} runs {stage.executor!r}, not a Qwen3-Omni "
            "Thinker nor SmolLM2: it has no chat tokenizer; pass prompt_token_ids to submit() instead"
        )
    return functools.partial(prompts.encode_prompt, system=system)


def prompt_side(
    pipeline: str | os.PathLike[str] | PipelineConfig, *, announce: Announce | None = None
) -> PromptSide | None:
    """The prompt side of ``pipeline``'s prompt stage (chat and speech prompts, media
    placeholders, detokenizing) when it runs a text model, else None. Its tokenizer is
    loaded now, in this process; what it needs first is made ready, each step inside
    ``announce(label, done=...)`` (a progress report; default: silent)."""
    from omnirelay import models

    config = pipeline if isinstance(pipeline, PipelineConfig) else load_pipeline(pipeline)
    return models.prompt_side(config, announce=announce or quiet)


class Pipeline:
    """A running pipeline: one worker process per stage and the front-side orchestrator.

    Build it with :meth:`start`; see the module docstring.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        *,
        tokenizer: Callable[[str], list[int]] | None,
    ) -> None:
        # Use Pipeline.start(): it builds these in the right order.
        self._orch = orchestrator
        self._loop = loop
        self._thread = thread
        self._tokenizer = tokenizer
        self._precheck = Router(orchestrator.config)  # pure queries only (plan, checks)
        self._prompt_lock = threading.Lock()
        self._prompt_side: PromptSide | None = None
        self._has_prompt_side = False
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._is_closed = False
        self._report: ShutdownReport | None = None
        self._shutdown_lock = threading.Lock()
        ref = weakref.ref(self)
        self._atexit = lambda: (p := ref()) is not None and p.shutdown()
        atexit.register(self._atexit)

    # -- start ---------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        pipeline: str | os.PathLike[str] | PipelineConfig,
        options: PipelineOptions | None = None,
        *,
        runtime: RuntimeHooks | None = None,
        **settings: Any,
    ) -> Pipeline:
        """Load the pipeline, spawn its workers, wait until every engine is built.

        ``pipeline``: a YAML path, a shipped name (``qwen3-omni-tiny``) or a config.
        ``options``: the user's settings (:class:`~omnirelay.api.options.PipelineOptions`),
        or the same as keywords (``Pipeline.start("voice-cpu", tokenizer=...)``), not both.
        ``runtime``: the runtime's internals a test or a benchmark replaces
        (:class:`~omnirelay.api.options.RuntimeHooks`: engine factory, input builders,
        registry, wait slices). With the default engine factory, models that need
        preparing on first use are prepared first, in this process (cached; later starts
        skip it). Raises :class:`~omnirelay.errors.StageDiedError` when a stage cannot
        start, :class:`ConfigError` for a setting that is wrong or unknown.
        """
        if options is not None and settings:
            raise ConfigError("pass the pipeline's options or its settings as keywords, not both")
        opts = options if options is not None else PipelineOptions.from_settings(settings)
        hooks = runtime if runtime is not None else RuntimeHooks()
        config, ns = _config_and_namespace(pipeline, opts.namespace, opts.async_chunk, hooks.registry)
        if opts.restart is not None:
            config = config.with_restart(opts.restart)
        if hooks.engine_factory == DEFAULT_ENGINE_FACTORY:
            # Models that need work on first use (SmolLM2's conversion) are made ready once,
            # here, before the workers start: not by several workers racing, and not inside
            # the startup timeout, which then covers loading only.
            from omnirelay.models import prepare_models

            prepare_models(config.stages)
        input_builders = hooks.input_builders
        if input_builders is None:
            from omnirelay.orchestrator.input_builders import build_input_builders

            input_builders = build_input_builders(config)
        orch = Orchestrator(
            config,
            namespace=ns,
            engine_factory=hooks.engine_factory,
            input_builders=input_builders,
            startup_timeout_s=opts.startup_timeout_s,
            idle_wait_s=hooks.idle_wait_s,
            wait_slice_s=hooks.wait_slice_s,
            on_stage_output=opts.on_stage_output,
            tracer_factory=StepRecorder if opts.trace_steps else None,
            on_stage_ready=opts.on_stage_ready,
            off_stages=_off_stages(config, opts),
        )
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=_run_loop, args=(loop,), name=f"omnirelay-front-{ns}", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(orch.start(), loop).result()
        except BaseException:
            _stop_loop(loop, thread)
            raise
        return cls(orch, loop, thread, tokenizer=opts.tokenizer)

    @classmethod
    async def start_async(
        cls,
        pipeline: str | os.PathLike[str] | PipelineConfig,
        options: PipelineOptions | None = None,
        *,
        runtime: RuntimeHooks | None = None,
        **settings: Any,
    ) -> Pipeline:
        """:meth:`start` without blocking the caller's event loop (a server's startup)."""
        return await asyncio.to_thread(cls.start, pipeline, options, runtime=runtime, **settings)

    # -- properties ----------------------------------------------------------------------------

    def prompt_side(self) -> PromptSide | None:
        """The prompt side of the prompt stage (:func:`prompt_side`), loaded on first call
        and kept; None when that stage is not a text model."""
        with self._prompt_lock:
            if not self._has_prompt_side:
                self._prompt_side = prompt_side(self.config)
                self._has_prompt_side = True
            return self._prompt_side

    @property
    def config(self) -> PipelineConfig:
        return self._orch.config

    @property
    def namespace(self) -> str:
        return self._orch.namespace

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def num_active(self) -> int:
        """Requests submitted whose last output has not been delivered yet."""
        with self._lock:
            return len(self._active)

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        modalities: Sequence[str] | str | None = None,
        sampling: SamplingParams | Mapping[int, SamplingParams] | None = None,
        request_id: str | None = None,
        inputs: Any = None,
        extras: Mapping[str, Any] | None = None,
        entry_stage_id: int | None = None,
        hold_id: bool = False,
        session: str | None = None,
        buffered: bool = False,
    ) -> RequestHandle:
        """Start one request; never blocks. Returns its :class:`RequestHandle`.

        ``modalities``: the outputs wanted (``["text"]``, ``["text", "audio"]`` …; None or
        none known: every final output). ``sampling``: one :class:`SamplingParams` for
        the prompt stage (:attr:`PipelineConfig.prompt_stage_id`: stage 0, or the stage
        behind an ``entry_input`` stage), or ``{stage_id: SamplingParams}``; other stages
        use their config's defaults. ``inputs``: a full input for the entry stage (prompt
        embeddings, a Thinker's audio). ``entry_stage_id``: where the request enters (None:
        the prompt stage; :attr:`PipelineConfig.audio_entry_stage_id` for a request whose
        audio a speech-recognition stage hears first).
        Raises :class:`InvalidRequestError` for a malformed request (nothing started), and
        :class:`~omnirelay.errors.StageUnavailableError` when a stage the request needs is
        down (restarting, or given up on); a request that does not need it is served.
        ``hold_id``: the request id stays in flight until the handle is also closed
        (:meth:`RequestHandle.close`), not only until its last output is delivered.
        ``session``: a key shared by the requests of one conversation or realtime session;
        a stage with replicas serves them on one replica where its load allows.
        ``buffered``: the caller keeps the outputs until the answer is whole (it reads it
        with :meth:`RequestHandle.result`, or answers only at the end), so when a replica
        the request is bound to dies it runs again on another from the start, however far
        it got; iterating its handle then yields a ``restarted`` output, after which the
        answer begins again (docs/protocol.md §2.9).
        """
        rid = uuid.uuid4().hex if request_id is None else validate_request_id(request_id)
        req_extras = dict(extras or {})
        ids = self._prompt_ids(_validate_prompt(prompt_token_ids), text, req_extras)
        request = PipelineRequest(
            request_id=rid,
            prompt_token_ids=ids,
            modalities=requested_modalities(modalities),
            sampling=self._sampling(sampling),
            inputs=inputs,
            extras=req_extras,
            entry_stage_id=entry_stage_id,
            session=_validate_session(session),
            buffered=bool(buffered),
        )
        plan = self._precheck.check_admissible(request)
        if plan.entry_stage_id in self._orch.off_stages:
            raise InvalidRequestError(
                f"request {rid!r} carries audio, but this pipeline was started without audio input "
                "(PipelineOptions.audio_input=False): its recognizer stage is not running"
            )
        down = self._orch.unavailable(plan.path)
        if down is not None:
            _, reason, retry_after_s = down
            raise StageUnavailableError(rid, reason, retry_after_s=retry_after_s)
        handle = RequestHandle(rid, abort=self.abort, on_done=self._forget, is_held=hold_id)
        with self._lock:
            if self._is_closed:
                raise PipelineError("the pipeline is shut down; start a new one")
            if rid in self._active:
                raise InvalidRequestError(
                    f"request id {rid!r} is already in flight; wait for it to finish or abort it first"
                )
            self._active.add(rid)
        try:
            self._loop.call_soon_threadsafe(self._orch.admit, request, handle)
        except RuntimeError:  # shut down between the check above and here
            self._forget(rid)
            raise PipelineError("the pipeline is shut down; start a new one") from None
        return handle

    def generate(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        timeout_s: float | None = None,
        **submit_args: Any,
    ) -> RequestResult:
        """Run one request and return its whole answer (blocking): :meth:`submit` with the
        same arguments, ``buffered`` since the caller has nothing before the end (a replica
        lost on the way runs it again from the start, docs/protocol.md §2.9), then
        :meth:`RequestHandle.result`. Past ``timeout_s`` the request is aborted and
        ``TimeoutError`` raised."""
        handle = self.submit(prompt_token_ids, **_whole_answer(submit_args))
        try:
            return handle.result(timeout_s)
        except TimeoutError:
            handle.abort()
            raise

    async def generate_async(
        self, prompt_token_ids: Sequence[int] | None = None, **submit_args: Any
    ) -> RequestResult:
        """:meth:`generate` from an event loop (cancelling it aborts the request)."""
        handle = self.submit(prompt_token_ids, **_whole_answer(submit_args))
        try:
            return await handle.result_async()
        except asyncio.CancelledError:
            handle.abort()
            raise

    def _prompt_ids(
        self, ids: list[int] | None, text: str | None, extras: dict[str, Any]
    ) -> list[int] | None:
        """The prompt's token ids: ``ids``, or ``text`` through the pipeline's tokenizer
        (kept in ``extras`` as ``prompt_text``)."""
        if text is None:
            return ids
        if ids is not None:
            raise InvalidRequestError("pass prompt_token_ids or text, not both")
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a str, got {type(text).__name__}")
        if self._tokenizer is None:
            raise InvalidRequestError(
                "this pipeline was started without a tokenizer; pass prompt_token_ids, "
                "or Pipeline.start(..., tokenizer=...)"
            )
        extras.setdefault("prompt_text", text)
        return _validate_prompt(self._tokenizer(text))

    def _sampling(
        self, sampling: SamplingParams | Mapping[int, SamplingParams] | None
    ) -> dict[int, SamplingParams]:
        if sampling is None:
            return {}
        if isinstance(sampling, SamplingParams):
            return {self.config.prompt_stage_id: sampling}
        if not isinstance(sampling, Mapping):
            raise InvalidRequestError(
                f"sampling must be a SamplingParams or a {{stage_id: SamplingParams}} mapping, got {sampling!r}"
            )
        out: dict[int, SamplingParams] = {}
        for sid, params in sampling.items():
            if isinstance(sid, bool) or not isinstance(sid, int) or not 0 <= sid < self.config.num_stages:
                raise InvalidRequestError(
                    f"sampling has a key {sid!r}; use stage ids 0..{self.config.num_stages - 1}"
                )
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError(f"sampling[{sid}] must be a SamplingParams, got {params!r}")
            out[sid] = params
        return out

    def capacity_problem(self, modalities: Sequence[str] | None) -> str | None:
        """Why a request for ``modalities`` would wait for an audio stream if submitted
        now (the pipeline's real-time capacity: ``max_audio_streams``, or a stream running
        dry; :class:`~omnirelay.orchestrator.capacity.StreamGate`); None: it starts at
        once. A server answers 429 instead of letting it wait."""
        orch = self._orch
        if not orch.is_audio_modalities(requested_modalities(modalities)):
            return None
        if orch.num_waiting:
            return f"{orch.num_waiting} request(s) are waiting for an audio stream"
        return orch.streams.why_not(time.monotonic())

    def is_in_flight(self, request_id: str) -> bool:
        """Whether ``request_id`` is taken: submitted, and not yet free again."""
        with self._lock:
            return request_id in self._active

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._active.discard(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its handle ends with ``finish_reason == "abort"``. Never blocks;
        an id not in flight is a no-op."""
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a str, got {type(request_id).__name__}")
        if self._is_closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._orch.abort, request_id)
        except RuntimeError:  # the loop closed under us: shut down, nothing to abort
            pass

    # -- queries -------------------------------------------------------------------------------

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        if self._is_closed:
            coro.close()
            raise PipelineError("the pipeline is shut down")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    async def _call_async(self, coro: Any) -> Any:
        if self._is_closed:
            coro.close()
            raise PipelineError("the pipeline is shut down")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def health(self, timeout_s: float = 2.0) -> PipelineHealth:
        """Per stage worker (each replica of a replicated stage): alive, pid, exit code,
        requests held, queue depth, engine health, state (``starting``, ``healthy``,
        ``restarting``, ``failed``) and restarts."""
        result: PipelineHealth = self._call(self._orch.health(timeout_s))
        return result

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every stage is ``healthy`` (a restarted stage said hello). Raises
        :class:`~omnirelay.errors.StageDiedError` when a stage was given up on, and
        :class:`TimeoutError` after ``timeout_s``."""
        self._call(self._orch.wait_ready(timeout_s))

    async def health_async(self, timeout_s: float = 2.0) -> PipelineHealth:
        result: PipelineHealth = await self._call_async(self._orch.health(timeout_s))
        return result

    def leak_state(self, timeout_s: float = 5.0, settle_s: float = 2.0) -> dict[int, dict[str, Any]]:
        """Each live worker's books (``{"worker": ..., "engine": engine.leak_state()}``) by
        worker index (the stage id when no stage has replicas), taken once its in-flight
        cleanup settled (at most ``settle_s``). Every release sent before this call has
        been applied when it returns. For audits and tests."""
        result: dict[int, dict[str, Any]] = self._call(self._orch.leak_state(timeout_s, settle_s))
        return result

    def placement(self) -> dict[str, Any]:
        """Where each stage worker runs (``stages``: by worker index — the stage id when no
        stage has replicas — node id, address, host name, stage and replica) and each
        edge's connector backend (``edges``: ``"src -> dst"`` -> backend)."""
        config = self._orch.config
        return {
            "backend": config.placement.backend,
            "stages": {sid: dict(node) for sid, node in self._orch.placement_report().items()},
            "edges": {e.label: e.backend for e in config.edges()},
        }

    def leaks(self, timeout_s: float = 5.0, settle_s: float = 2.0) -> list[str]:
        """Where any stage still holds per-request state or transfer objects, as
        ``"stage N: path=value"`` lines of :meth:`leak_state`; ``[]`` when every request
        that ended left nothing behind. Call it when no request is in flight."""
        return _leak_lines(self.leak_state(timeout_s, settle_s), self.config)

    async def leaks_async(self, timeout_s: float = 5.0, settle_s: float = 2.0) -> list[str]:
        """:meth:`leaks` from an event loop (the server's ``/health?audit=1``)."""
        books = await self._call_async(self._orch.leak_state(timeout_s, settle_s))
        return _leak_lines(books, self.config)

    def transfer_objects(self) -> list[str]:
        """The names of the transfer objects of this pipeline's namespace that exist now,
        every connector backend's; pooled slots, which live as long as the stages, are not
        counted. Reclaims nothing. It reads the system's namespaces: from an event loop, run
        it in a thread."""
        report = reclaim_namespace(self.namespace, reclaim=False)
        return [o.name for o in report.transfer_objects]

    def pids(self) -> dict[int, int | None]:
        """Worker pids by stage id (a replicated stage's replica 0)."""
        return self._orch.pids()

    def replica_pids(self) -> dict[tuple[int, int], int | None]:
        """Every worker's pid by ``(stage id, replica)``."""
        return self._orch.replica_pids()

    # -- shutdown ------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 10.0) -> ShutdownReport:
        """Fail what is in flight, stop every worker, close the control plane, reclaim the
        namespace. Idempotent: later calls return the first report."""
        with self._shutdown_lock:
            if self._report is not None:
                return self._report
            with self._lock:
                self._is_closed = True
            try:
                fut = asyncio.run_coroutine_threadsafe(self._orch.shutdown(timeout_s), self._loop)
                self._report = fut.result()
            finally:
                _stop_loop(self._loop, self._thread)
                atexit.unregister(self._atexit)
            return self._report

    async def shutdown_async(self, timeout_s: float = 10.0) -> ShutdownReport:
        """:meth:`shutdown` without blocking the caller's event loop."""
        return await asyncio.to_thread(self.shutdown, timeout_s)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._is_closed else "running"
        return f"Pipeline({self.config.name!r}, namespace={self.namespace!r}, {state})"


def _whole_answer(submit_args: dict[str, Any]) -> dict[str, Any]:
    """``submit``'s arguments for a whole-answer call: buffered, and no held id (its handle
    is never the caller's to close)."""
    for name in ("buffered", "hold_id"):
        if name in submit_args:
            raise InvalidRequestError(f"generate() takes no {name}: it is always buffered and frees its id")
    return {**submit_args, "buffered": True}


def _config_and_namespace(
    pipeline: str | os.PathLike[str] | PipelineConfig,
    namespace: str | None,
    async_chunk_override: bool | None,
    registry: ComponentRegistry | None,
) -> tuple[PipelineConfig, str]:
    """The pipeline's config and its /dev/shm namespace: ``namespace``, else the file's,
    else a fresh ``p<pid>x…`` one (a :class:`ConfigError` when it is not usable)."""
    if isinstance(pipeline, PipelineConfig):
        config = pipeline if async_chunk_override is None else pipeline.with_async_chunk(async_chunk_override)
    else:
        config = load_pipeline(pipeline, async_chunk_override=async_chunk_override, registry=registry)
    ns = namespace or config.namespace or f"p{os.getpid()}x{next(_NAMESPACE_COUNTER)}{secrets.token_hex(2)}"
    try:
        validate_namespace(ns)
    except InvalidKeyError as exc:
        raise ConfigError(str(exc)) from exc
    return config, ns


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
    if thread is not threading.current_thread():
        thread.join()


def _leak_lines(books: dict[int, dict[str, Any]], config: PipelineConfig) -> list[str]:
    """``stage N: path`` (``stage N replica R: path`` for a replicated stage's worker)."""
    workers = {w.index: w for w in config.workers()}

    def where(index: int) -> str:
        if index < 0:
            return "front"
        w = workers.get(index)
        if w is None or config.stages[w.stage_id].replicas == 1:
            return f"stage {index if w is None else w.stage_id}"
        return f"stage {w.stage_id} replica {w.replica}"

    return [f"{where(index)}: {path}" for index, state in sorted(books.items()) for path in leak_paths(state)]
