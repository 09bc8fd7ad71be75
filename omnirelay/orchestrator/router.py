"""One request's path across the stages (docs/protocol.md §2.1–§2.8), as a pure state machine.

No I/O, no clocks, no awaits (docs/design.md §7): every entry point takes plain data and returns
the :data:`Action` s the caller must carry out, in order —

* :class:`StageSubmit` — hand a :class:`StageRequest` to a stage (the replica the request
  is bound to there);
* :class:`StageAbort` — abort the request in a stage that still holds it;
* :class:`StageRelease` — no stage needs the request any more: the stage drops its
  transfer objects and state for the id (docs/protocol.md §2.8); sent to **every** stage
  (to the replica the request was bound to; a replicated stage it never entered has
  nothing of it and is not told);
* :class:`ClientOutput` — a :class:`RequestOutput` for the client; the one with
  ``finished=True`` is the last for that request;
* :class:`Rerun` — the request lost a replica before the client got anything (for a
  ``buffered`` request: before its last output): it ended in every stage (aborts and
  releases above) and is to be admitted again, unchanged, once the stages released its
  id (docs/design.md §11); a buffered request's consumer that got outputs of the failed
  attempt is told first (a ``restarted`` :class:`ClientOutput`).

**Replicas.** A stage may run several worker processes. When a request enters a stage
(admission, prewarm, forwarding) it is bound to one replica there, chosen by the
:class:`~omnirelay.orchestrator.replicas.ReplicaBalancer` from the load the router booked,
the capacity each replica reported, the request's session (affinity) and which replicas
are up. Its request to the previous stage names that replica (``send_to_replica``), so
each edge of the request connects exactly the two replicas it is bound to.

Entry points (each called on the orchestrator's thread, once per event):

* :meth:`Router.admit` — admission and prewarm (§2.2, §2.3);
* :meth:`Router.on_output` — route one :class:`StageOutput` (§2.4), forward finished
  outputs to non-chunk stages through their input builders (§2.5), completion (§2.6);
* :meth:`Router.abort` (§2.7), :meth:`Router.fail`, :meth:`Router.on_replica_died`,
  :meth:`Router.on_stage_died`, :meth:`Router.fail_all` — the other ways a request ends;
* :meth:`Router.set_unavailable` / :meth:`Router.on_stage_back` /
  :meth:`Router.on_replica_back` — what admissions that need a down stage are told while
  it restarts, and its (or one replica's) return.

Whatever way a request ends, the router forgets it and, in the same action list, tells
every stage that still holds it to abort and every stage to release it. A failure in any
stage (an output with ``error`` or ``finish_reason == "error"``) fails the whole request
at once with that stage's reason (docs/protocol.md §10.7).

Streaming *sessions* (one request fed by several input segments) are not modelled: the
hold rule's "not streaming" condition is always true here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from omnirelay.engine.interfaces import SamplingParams, StageOutput, StageRequest
from omnirelay.errors import InvalidRequestError
from omnirelay.orchestrator.replicas import ReplicaBalancer
from omnirelay.orchestrator.requests import (
    InputBuilder,
    PipelineRequest,
    RequestOutput,
    RequestPlan,
    SourceOutput,
    default_input_builder,
    stage_sampling_defaults,
)
from omnirelay.pipeline import PipelineConfig, placeholder_prompt_len

__all__ = [
    "TRANSCRIPT",
    "Action",
    "ClientOutput",
    "Rerun",
    "Router",
    "StageAbort",
    "StageRelease",
    "StageSubmit",
]


#: The modality of what a recognizer stage heard (``entry_input: audio``); a request for it
#: alone ends at that stage (``/v1/audio/transcriptions``).
TRANSCRIPT = "transcript"

# ------------------------------------------------------------------------ actions


class StageSubmit(msgspec.Struct, frozen=True):
    stage_id: int
    request: StageRequest
    replica: int = 0


class StageAbort(msgspec.Struct, frozen=True):
    stage_id: int
    request_id: str
    replica: int = 0


class StageRelease(msgspec.Struct, frozen=True):
    stage_id: int
    request_id: str
    replica: int = 0


class ClientOutput(msgspec.Struct, frozen=True):
    request_id: str
    output: RequestOutput


class Rerun(msgspec.Struct, frozen=True):
    """Admit ``request`` again once its id is released everywhere; ``num_reruns`` counts
    this one (the next admission passes it back to :meth:`Router.admit`)."""

    request: PipelineRequest
    num_reruns: int


Action = StageSubmit | StageAbort | StageRelease | ClientOutput | Rerun

#: How often one request may be run again after losing a replica.
MAX_RERUNS = 3
#: what a request's failure adds when it lost a replica once more than that
RERUN_BOUND_NOTE = f"the request had already run again {MAX_RERUNS} times, the most it is"


@dataclass
class _Accumulator:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    audio: list[Any] = field(default_factory=list)
    sample_rate: int | None = None


@dataclass
class _RequestState:
    """Per-request books (docs/protocol.md §2.1)."""

    request: PipelineRequest
    plan: RequestPlan
    finals: frozenset[int]
    submitted: set[int] = field(default_factory=set)
    finished_stages: set[int] = field(default_factory=set)
    finished_finals: set[int] = field(default_factory=set)
    #: the held request-level final message (hold rule, §2.4 step 3)
    pending: RequestOutput | None = None
    #: outputs of stages whose finished output will be forwarded (§2.5)
    sources: dict[int, _Accumulator] = field(default_factory=dict)
    last_sample_rate: dict[int, int] = field(default_factory=dict)
    #: stage id -> the replica the request is bound to there
    bound: dict[int, int] = field(default_factory=dict)
    #: stages whose replica's booked load still counts this request
    loaded: set[int] = field(default_factory=set)
    #: the consumer got an output of it (for a request not ``buffered``, the client has
    #: it: a rerun would deliver it twice)
    has_delivered: bool = False
    #: how often it was run again after losing a replica
    num_reruns: int = 0
    #: the prompt stage's text so far, when a later stage gets a forwarded input (what a
    #: voice spoke of the answer: an aligner's text, :attr:`SourceOutput.answer_text`)
    answer: list[str] = field(default_factory=list)

    @property
    def holders(self) -> list[int]:
        """Stages given the request that have not reported it finished."""
        return sorted(self.submitted - self.finished_stages)

    def all_submitted_finished(self) -> bool:
        return self.submitted <= self.finished_stages


# -------------------------------------------------------------------------- router


class Router:
    """Routing state of every request in flight; see the module docstring."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        input_builders: Mapping[int, InputBuilder] | None = None,
    ) -> None:
        self.config = config
        self.is_chunked = config.any_stage_chunks()  # §1.4: never read off stage 0
        self._receives = tuple(config.stage_receives_chunks(s) for s in config.stages)
        builders = dict(input_builders or {})
        self._builders: dict[int, InputBuilder] = {
            s.id: builders.get(s.id, default_input_builder) for s in config.stages
        }
        self._all_stage_ids = tuple(s.id for s in config.stages)
        self._num_replicas = {s.id: s.replicas for s in config.stages}
        self.balancer = ReplicaBalancer(
            self._num_replicas, capacity={s.id: s.max_num_seqs for s in config.stages}
        )
        self._requests: dict[str, _RequestState] = {}
        #: stages that cannot take requests now: stage id → (reason, retry-after seconds)
        self._dead: dict[int, tuple[str, float | None]] = {}
        self.num_dropped_outputs = 0  # outputs of requests that had already ended

    # -- queries ----------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def holders(self, request_id: str) -> list[int]:
        """Stages that hold the request (given it, not finished); [] for an unknown id."""
        st = self._requests.get(request_id)
        return [] if st is None else st.holders

    def num_requests_on(self, stage_id: int, replica: int | None = None) -> int:
        """Requests a stage (one replica of it) holds: its queue depth as the front sees it."""
        return sum(
            1
            for st in self._requests.values()
            if stage_id in st.submitted - st.finished_stages
            and (replica is None or st.bound.get(stage_id) == replica)
        )

    def binding(self, request_id: str) -> dict[int, int]:
        """The replica of each stage the request is bound to ({} for an unknown id)."""
        st = self._requests.get(request_id)
        return {} if st is None else dict(st.bound)

    def dead_stages(self) -> dict[int, str]:
        """Stages that cannot take requests now, with the reason."""
        return {sid: reason for sid, (reason, _) in self._dead.items()}

    def plan(self, modalities: Iterable[str] | None, entry_stage_id: int | None = None) -> RequestPlan:
        """Final outputs, final stage and prewarmed stages for these modalities, entering at
        ``entry_stage_id`` (None: the prompt stage) (pure)."""
        cfg = self.config
        entry = cfg.prompt_stage_id if entry_stage_id is None else entry_stage_id
        finals = cfg.final_output_stage_ids(modalities)
        final_stage_id = cfg.final_stage_id(modalities)
        if entry == cfg.audio_entry_stage_id and modalities is not None and set(modalities) == {TRANSCRIPT}:
            # Only what the recognizer heard (a transcription): it is the one final output.
            finals, final_stage_id = (entry,), entry
        prewarm: tuple[int, ...] = ()
        if self.is_chunked and final_stage_id > entry:
            # §2.3: a stage that does not receive chunks gets its real input by
            # forwarding; prewarming it would let it run before its input exists.
            prewarm = tuple(s for s in range(entry + 1, final_stage_id + 1) if self._receives[s])
        return RequestPlan(
            final_output_stage_ids=tuple(finals),
            final_stage_id=final_stage_id,
            prewarm_stage_ids=prewarm,
            entry_stage_id=entry,
        )

    def check_admissible(self, request: PipelineRequest) -> RequestPlan:
        """Client errors that need no state (§2.3 step 3); raises :class:`InvalidRequestError`."""
        entry = request.entry_stage_id
        allowed = sorted(
            s for s in (self.config.prompt_stage_id, self.config.audio_entry_stage_id) if s is not None
        )
        if entry is not None and (isinstance(entry, bool) or entry not in allowed):
            raise InvalidRequestError(
                f"request {request.request_id!r} cannot enter pipeline {self.config.name!r} at stage "
                f"{entry!r}; requests enter at stage {' or '.join(map(str, allowed))}"
            )
        plan = self.plan(request.modalities, entry)
        if not request.prompt_token_ids and request.inputs is None:
            raise InvalidRequestError(
                f"request {request.request_id!r} has no prompt: pass prompt_token_ids (or inputs)"
            )
        if plan.prewarm_stage_ids and not request.prompt_token_ids:
            labels = ", ".join(self.config.stage(s).label for s in plan.prewarm_stage_ids)
            raise InvalidRequestError(
                f"request {request.request_id!r} has no prompt_token_ids (an embeds-only prompt), so "
                f"{labels} cannot be prewarmed for chunk streaming; pass prompt_token_ids, or request "
                f"only modalities served before the first chunk-receiving stage"
            )
        return plan

    # -- admission (§2.2, §2.3) -----------------------------------------------------------

    def admit(self, request: PipelineRequest, *, num_reruns: int = 0) -> list[Action]:
        """Create the request's state, bind it to a replica of its entry stage and of each
        prewarmed stage, and submit the entry stage plus the prewarm placeholders.

        Raises :class:`InvalidRequestError` for a client error (nothing changed). A dead
        stage on the request's path ends the request at once (a failed terminal output).
        ``num_reruns``: a :class:`Rerun` admitted again says how often it ran before.
        """
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequestError(
                f"request id {rid!r} is already in flight; wait for it to finish or abort it first"
            )
        plan = self.check_admissible(request)
        st = _RequestState(
            request=request,
            plan=plan,
            finals=frozenset(plan.final_output_stage_ids),
            num_reruns=num_reruns,
        )
        for s in plan.path:
            if s < plan.final_stage_id and self._forwards_from(s):
                st.sources[s] = _Accumulator()
        self._requests[rid] = st
        dead = [s for s in plan.path if s in self._dead]
        if dead:
            return self._fail_unavailable(rid, dead[0])
        entry = plan.entry_stage_id
        for s in (entry, *plan.prewarm_stage_ids):
            if not self._bind(st, s):
                return self._fail_no_replica(rid, s)
        actions: list[Action] = [StageSubmit(entry, self._first_request(st), st.bound[entry])]
        st.submitted.add(entry)
        for s in plan.prewarm_stage_ids:
            actions.append(StageSubmit(s, self._placeholder_request(st, s), st.bound[s]))
            st.submitted.add(s)
        return actions

    def _bind(self, st: _RequestState, stage_id: int) -> bool:
        """Bind the request to a replica of ``stage_id`` and book it there; False when no
        replica of the stage is up."""
        replica = self.balancer.choose(stage_id, st.request.session)
        if replica is None:
            return False
        st.bound[stage_id] = replica
        self.balancer.bind(stage_id, replica)
        st.loaded.add(stage_id)
        return True

    def _unload(self, st: _RequestState, stage_id: int) -> None:
        """The replica of ``stage_id`` is done with the request: its booked load drops."""
        if stage_id in st.loaded:
            st.loaded.discard(stage_id)
            self.balancer.unbind(stage_id, st.bound[stage_id])

    def _fail_no_replica(self, request_id: str, stage_id: int) -> list[Action]:
        label = self._label(stage_id)
        return self.fail(
            request_id, f"{label} has no replica up", stage_id=stage_id, code="stage_unavailable"
        )

    def _forwards_from(self, s: int) -> bool:
        """Is the edge ``s -> s+1`` a forwarding (complete input) edge for the orchestrator?"""
        return not (self.is_chunked and self._receives[s + 1])

    def _sampling(self, st: _RequestState, stage_id: int) -> SamplingParams:
        given = st.request.sampling.get(stage_id)
        return given if given is not None else stage_sampling_defaults(self.config.stage(stage_id))

    def _first_request(self, st: _RequestState) -> StageRequest:
        req = st.request
        return StageRequest(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids or []),
            sampling=self._sampling(st, st.plan.entry_stage_id),
            inputs=req.inputs,
            final_stage_id=st.plan.final_stage_id,
            extras=dict(req.extras),
            send_to_replica=st.bound.get(st.plan.entry_stage_id + 1, 0),
        )

    def _placeholder_request(self, st: _RequestState, stage_id: int) -> StageRequest:
        req = st.request
        n = placeholder_prompt_len(
            req.prompt_token_ids or [], override=self.config.stage(stage_id).async_chunk_prewarm_prompt_len
        )
        return StageRequest(
            request_id=req.request_id,
            prompt_token_ids=[0] * n,
            sampling=self._sampling(st, stage_id),
            is_placeholder=True,
            final_stage_id=st.plan.final_stage_id,
            extras=dict(req.extras),
            send_to_replica=st.bound.get(stage_id + 1, 0),
        )

    # -- routing (§2.4) -----------------------------------------------------------------

    def on_output(self, out: StageOutput, replica: int | None = None) -> list[Action]:
        """Route one stage output of one request (from ``replica`` of its stage, when the
        caller knows: an output of a replica the request is not bound to is dropped)."""
        st = self._requests.get(out.request_id)
        if st is None:
            self.num_dropped_outputs += 1  # the request already ended (abort, failure)
            return []
        s = out.stage_id
        if replica is not None and s in st.bound and st.bound[s] != replica:
            self.num_dropped_outputs += 1  # an earlier binding's (a rerun's former replica)
            return []
        actions = self._route(st, out)
        if out.request_id in self._requests and any(isinstance(a, ClientOutput) for a in actions):
            st.has_delivered = True
        return actions

    def _route(self, st: _RequestState, out: StageOutput) -> list[Action]:
        s = out.stage_id
        label = self._label(s)
        if s not in st.submitted:
            return self.fail(
                out.request_id, f"{label} reported an output for a request it was never given", stage_id=s
            )
        if out.error is not None or out.finish_reason == "error":
            if out.finished:
                st.finished_stages.add(s)
            return self.fail(
                out.request_id, f"{label}: {out.error or 'the stage reported an error'}", stage_id=s
            )
        if out.finish_reason == "abort":
            # The orchestrator forgets a request when it aborts it, so this abort is the
            # stage's own: what runs after it would wait for input that never comes.
            if out.finished:
                st.finished_stages.add(s)
            return self.fail(out.request_id, f"{label} aborted the request on its own", stage_id=s)
        if s in st.finished_stages:
            return self.fail(out.request_id, f"{label} reported an output after it finished", stage_id=s)
        if out.sample_rate is not None:
            st.last_sample_rate[s] = out.sample_rate
        if out.text and s == self.config.prompt_stage_id and any(f > s for f in st.sources):
            st.answer.append(out.text)
        acc = st.sources.get(s)
        if acc is not None:
            acc.token_ids.extend(out.token_ids)
            if out.text:
                acc.text.append(out.text)
            if out.audio is not None:
                acc.audio.append(out.audio)
            if out.sample_rate is not None:
                acc.sample_rate = out.sample_rate
        actions: list[Action] = []
        is_recognizer = s == self.config.audio_entry_stage_id
        if out.finished:
            st.finished_stages.add(s)
            self._unload(st, s)
            if is_recognizer and s not in st.finals:
                actions.append(ClientOutput(out.request_id, self._transcript(out)))
        if s in st.finals:
            msg = self._transcript(out) if is_recognizer else self._message(st, out)
            self._final_message(st, msg, actions)
        if out.finished and out.request_id in self._requests:
            self._forward_ready(st, actions)
        if out.request_id in self._requests:
            self._release_pending(st, actions)
        return actions

    def _message(self, st: _RequestState, out: StageOutput) -> RequestOutput:
        return RequestOutput(
            request_id=out.request_id,
            stage_id=out.stage_id,
            modality=self._modality(out.stage_id),
            token_ids=list(out.token_ids),
            text=out.text,
            audio=out.audio,
            sample_rate=out.sample_rate,
            stage_finished=out.finished,
            finish_reason=out.finish_reason if out.finished else None,
            metrics=dict(out.metrics),
        )

    def _transcript(self, out: StageOutput) -> RequestOutput:
        """What the recognizer heard (docs/protocol.md §1.9): one output before the answer
        it prompted, or the last one of a request for the transcript alone."""
        return RequestOutput(
            request_id=out.request_id,
            stage_id=out.stage_id,
            modality=TRANSCRIPT,
            text=out.text or "",
            stage_finished=True,
            finish_reason=out.finish_reason if out.finished else None,
            metrics=dict(out.metrics),
        )

    def _final_message(self, st: _RequestState, msg: RequestOutput, actions: list[Action]) -> None:
        """§2.4 steps 2–3 and 6 for one message of a final-output stage."""
        if msg.stage_finished:
            st.finished_finals.add(msg.stage_id)
        is_done = st.finals <= st.finished_finals
        if is_done and self.is_chunked and not st.all_submitted_finished():
            # Hold rule: a downstream decoder finished before an upstream stage's
            # terminal output was routed; the last message waits for it (step 5).
            msg.finished = True
            st.pending = msg
            return
        msg.finished = is_done
        actions.append(ClientOutput(msg.request_id, msg))
        if is_done:
            self._end(st, actions)

    def _release_pending(self, st: _RequestState, actions: list[Action]) -> None:
        """§2.4 step 5: send the held message once every submitted stage finished."""
        if st.pending is not None and st.all_submitted_finished():
            msg, st.pending = st.pending, None
            actions.append(ClientOutput(msg.request_id, msg))
            self._end(st, actions)

    # -- forwarding (§2.5) ------------------------------------------------------------

    def _forward_ready(self, st: _RequestState, actions: list[Action]) -> None:
        """Forward every finished source whose input is complete: it and every stage before
        it on the request's path finished (their last outputs routed, so the answer's text is
        whole too), lowest first."""
        for s in sorted(st.sources):
            done = all(p in st.finished_stages for p in st.plan.path if p <= s)
            if not done or st.request.request_id not in self._requests:
                return
            self._forward(st, s, actions)

    def _forward(self, st: _RequestState, s: int, actions: list[Action]) -> None:
        final = st.plan.final_stage_id
        nxt = s + 1
        if s >= final or not self._forwards_from(s) or nxt in st.submitted:
            return
        rid = st.request.request_id
        if nxt in self._dead:
            actions.extend(self._fail_unavailable(rid, nxt))
            return
        if nxt not in st.bound and not self._bind(st, nxt):
            actions.extend(self._fail_no_replica(rid, nxt))
            return
        acc = st.sources.get(s) or _Accumulator()
        source = SourceOutput(
            stage_id=s,
            token_ids=list(acc.token_ids),
            text="".join(acc.text),
            audio=list(acc.audio),
            sample_rate=acc.sample_rate,
            finished=True,
            answer_text="".join(st.answer),
        )
        stage = self.config.stage(nxt)
        try:
            built = self._builders[nxt](source, st.request, stage)
        except Exception as exc:  # a builder bug or a bad output fails this request only
            actions.extend(self.fail(rid, f"{stage.label}: its input builder failed: {exc!r}", stage_id=nxt))
            return
        st.sources.pop(s, None)  # handed over; nothing else reads it
        if built is None:
            # Nothing to forward and the source is finished: the stages after s will
            # never run; end their final outputs with empty terminals (no hang).
            for f in range(nxt, final + 1):
                if f in st.finals and rid in self._requests:
                    self._final_message(st, self._empty_terminal(st, f), actions)
            return
        request = StageRequest(
            request_id=rid,
            prompt_token_ids=[int(t) for t in built.prompt_token_ids],
            sampling=self._sampling(st, nxt),
            inputs=built.inputs,
            final_stage_id=final,
            extras={**st.request.extras, **built.extras},
            send_to_replica=st.bound.get(nxt + 1, 0),
        )
        actions.append(StageSubmit(nxt, request, st.bound[nxt]))
        st.submitted.add(nxt)

    def _empty_terminal(self, st: _RequestState, stage_id: int) -> RequestOutput:
        modality = self._modality(stage_id)
        audio = torch.zeros(0, dtype=torch.float32) if modality == "audio" else None
        rate = st.last_sample_rate.get(stage_id) if audio is not None else None
        return RequestOutput(
            request_id=st.request.request_id,
            stage_id=stage_id,
            modality=modality,
            audio=audio,
            sample_rate=rate,
            stage_finished=True,
            finish_reason="stop",
        )

    # -- ends (§2.6, §2.7, §2.8) -----------------------------------------------------------

    def abort(self, request_id: str) -> list[Action]:
        """Abort a request: abort every stage that holds it, end it, release everywhere.

        Unknown ids (already ended) are a no-op.
        """
        st = self._requests.get(request_id)
        if st is None:
            return []
        actions: list[Action] = []
        if st.pending is not None:  # a held final message still carries content
            held, st.pending = st.pending, None
            held.finished = False
            actions.append(ClientOutput(request_id, held))
        terminal = RequestOutput(
            request_id=request_id,
            stage_id=st.plan.final_stage_id,
            modality=self._modality(st.plan.final_stage_id),
            finished=True,
            finish_reason="abort",
        )
        actions.append(ClientOutput(request_id, terminal))
        self._end(st, actions)
        return actions

    def fail(
        self,
        request_id: str,
        reason: str,
        *,
        stage_id: int | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> list[Action]:
        """Fail a request with ``reason``: the client gets an error terminal, every stage
        that holds it aborts it, every stage releases it. Unknown ids are a no-op.
        ``code`` / ``retry_after_s``: the terminal's :attr:`RequestOutput.error_code` and
        :attr:`RequestOutput.retry_after_s`."""
        st = self._requests.get(request_id)
        if st is None:
            return []
        terminal = RequestOutput(
            request_id=request_id,
            stage_id=-1 if stage_id is None else stage_id,
            modality="",
            finished=True,
            finish_reason="error",
            error=reason,
            error_code=code,
            retry_after_s=retry_after_s,
        )
        actions: list[Action] = [ClientOutput(request_id, terminal)]
        self._end(st, actions)
        return actions

    def on_stage_died(
        self, stage_id: int, reason: str, *, retry_after_s: float | None = None
    ) -> list[Action]:
        """Every worker of a stage is gone: fail every request that still needs it, with
        ``stage_unavailable``.

        A request needs the stage when the stage is on its path and has not finished it
        (it holds it, or would get it by prewarm or forwarding), or when the next stage
        still reads its chunks (:meth:`_needs`). Later admissions that
        need it fail at once, until :meth:`on_stage_back`; requests that do not need it
        (a text-only request when the Talker is down) go on.
        """
        for replica in range(self._num_replicas[stage_id]):
            self.balancer.mark_down(stage_id, replica)
        self._dead[stage_id] = (reason, retry_after_s)
        actions: list[Action] = []
        for rid, st in list(self._requests.items()):
            if self._needs(st, stage_id):
                actions.extend(self._fail_unavailable(rid, stage_id))
        return actions

    def on_replica_died(
        self, stage_id: int, replica: int, reason: str, *, retry_after_s: float | None = None
    ) -> list[Action]:
        """One worker of a stage is gone. While another replica of the stage is up, the
        requests bound to the dead one that still need it (:meth:`_needs`) are run again
        (:class:`Rerun`) when the client has had nothing of them yet — at most
        :data:`MAX_RERUNS` times — and fail with ``stage_unavailable`` otherwise (a stream
        already playing cannot be resumed elsewhere); new requests avoid the replica until
        :meth:`on_replica_back`. A ``buffered`` request's client has nothing before its
        last output, so it runs again whatever its consumer got; when that was something,
        a :attr:`~RequestOutput.restarted` output tells the consumer to drop it first.
        When it was the stage's last replica up, this is :meth:`on_stage_died`."""
        self.balancer.mark_down(stage_id, replica)
        if not self.balancer.has_up(stage_id):
            return self.on_stage_died(stage_id, reason, retry_after_s=retry_after_s)
        actions: list[Action] = []
        for rid, st in list(self._requests.items()):
            if st.bound.get(stage_id) != replica or not self._needs(st, stage_id):
                continue
            if (st.has_delivered and not st.request.buffered) or st.num_reruns >= MAX_RERUNS:
                # Another replica serves new requests now: the client may retry at once.
                why = reason if st.num_reruns < MAX_RERUNS else f"{reason}; {RERUN_BOUND_NOTE}"
                actions.extend(
                    self.fail(rid, why, stage_id=stage_id, code="stage_unavailable", retry_after_s=0.0)
                )
                continue
            if st.has_delivered:  # buffered: its consumer drops what the failed attempt gave
                actions.append(ClientOutput(rid, self._restarted(st)))
            self._end(st, actions)
            actions.append(Rerun(st.request, st.num_reruns + 1))
        return actions

    def _restarted(self, st: _RequestState) -> RequestOutput:
        return RequestOutput(
            request_id=st.request.request_id,
            stage_id=st.plan.final_stage_id,
            modality="",
            restarted=True,
        )

    def on_replica_back(self, stage_id: int, replica: int) -> None:
        """A replica's restarted worker said hello: it takes requests again (and so does
        its stage, if it was down)."""
        self.balancer.mark_up(stage_id, replica)
        self._dead.pop(stage_id, None)

    def set_capacity(self, stage_id: int, replica: int, capacity: int) -> None:
        """The requests a replica runs at once, as its worker reported (its hello)."""
        self.balancer.set_capacity(stage_id, replica, capacity)

    def _needs(self, st: _RequestState, stage_id: int) -> bool:
        """Does the request still need the stage's process? Yes while the stage has not
        finished it, and also after, while the next stage still reads the chunks the
        stage put: the sweep that follows a death reclaims the dead process's unread
        objects (docs/protocol.md §3.5), so the reader would wait for them forever."""
        if stage_id not in st.plan.path:
            return False
        if stage_id not in st.finished_stages:
            return True
        nxt = stage_id + 1
        return (
            self.is_chunked
            and nxt in st.plan.path
            and self._receives[nxt]
            and nxt in st.submitted
            and nxt not in st.finished_stages
        )

    def set_unavailable(self, stage_id: int, reason: str, retry_after_s: float | None) -> None:
        """What a request that needs the down stage is told now (the stage is restarting,
        starting, or given up on)."""
        self._dead[stage_id] = (reason, retry_after_s)

    def on_stage_back(self, stage_id: int) -> None:
        """The stage runs again (a restarted worker said hello): admit requests needing it."""
        self._dead.pop(stage_id, None)
        for replica in range(self._num_replicas[stage_id]):
            self.balancer.mark_up(stage_id, replica)

    def _fail_unavailable(self, request_id: str, stage_id: int) -> list[Action]:
        reason, retry_after_s = self._dead[stage_id]
        return self.fail(
            request_id, reason, stage_id=stage_id, code="stage_unavailable", retry_after_s=retry_after_s
        )

    def fail_all(self, reason: str) -> list[Action]:
        """Fail every request in flight (shutdown)."""
        actions: list[Action] = []
        for rid in list(self._requests):
            actions.extend(self.fail(rid, reason))
        return actions

    def _end(self, st: _RequestState, actions: list[Action]) -> None:
        """Forget the request; abort it where still held; release it in every stage.

        After a normal completion no stage holds it (the hold rule waited for them);
        aborting a holder anyway keeps "nothing left behind" true if a stage misbehaves.
        """
        rid = st.request.request_id
        del self._requests[rid]
        for s in list(st.loaded):
            self._unload(st, s)
        for s in st.holders:
            actions.append(StageAbort(s, rid, st.bound.get(s, 0)))
        for s in self._all_stage_ids:
            replica = st.bound.get(s)
            if replica is not None:
                actions.append(StageRelease(s, rid, replica))
            elif self._num_replicas[s] == 1:
                actions.append(StageRelease(s, rid, 0))

    # -- naming -------------------------------------------------------------------------

    def _label(self, stage_id: int) -> str:
        try:
            return self.config.stage(stage_id).label
        except Exception:
            return f"stage {stage_id}"

    def _modality(self, stage_id: int) -> str:
        if stage_id == self.config.audio_entry_stage_id:
            return TRANSCRIPT
        t = self.config.stage(stage_id).final_output_type
        return "" if t is None else str(t)
