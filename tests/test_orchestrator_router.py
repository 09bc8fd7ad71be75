"""The orchestrator's routing state machine (docs/protocol.md §2.1–§2.8), pure: no processes, no I/O.

Every test ends with the router's books empty (no request state left) and, for every
request that ended, a release to every stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams, StageOutput
from omnirelay.errors import InvalidRequestError
from omnirelay.orchestrator.requests import (
    ForwardedInput,
    PipelineRequest,
    RequestOutput,
    SourceOutput,
    default_input_builder,
    requested_modalities,
    stage_sampling_defaults,
)
from omnirelay.orchestrator.router import (
    Action,
    ClientOutput,
    Router,
    StageAbort,
    StageRelease,
    StageSubmit,
)
from omnirelay.pipeline import PipelineConfig, StageConfig, parse_pipeline, placeholder_prompt_len

# <|im_start|> user ... <|im_start|> assistant: placeholder length = user span + 9
PROMPT = [151644, 872, 11, 12, 13, 151644, 77091]


def _stage(sid: int, name: str, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": sid, "name": name, "execution_type": "ar", "executor": f"fake.{name}"}
    if sid > 0:
        out["input_sources"] = [sid - 1]
    out.update(kw)
    return out


def omni(**top: Any) -> PipelineConfig:
    """Thinker (text) -> Talker -> Code2Wav (audio), chunk edges."""
    return parse_pipeline(
        {
            "name": "omni",
            "stages": [
                _stage(0, "thinker", chunk_processor="c0", final_output=True, final_output_type="text"),
                _stage(1, "talker", chunk_processor="c1", sampling={"max_tokens": 7, "seed": 42}),
                _stage(
                    2, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"
                ),
            ],
            **top,
        }
    )


def tts_aligner() -> PipelineConfig:
    """Talker -> Code2Wav (audio, chunks) -> aligner (timestamps, complete input)."""
    return parse_pipeline(
        {
            "name": "tts",
            "stages": [
                _stage(0, "talker", chunk_processor="c0"),
                _stage(
                    1, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"
                ),
                _stage(
                    2,
                    "aligner",
                    execution_type="generation",
                    async_chunk=False,
                    input_builder="code2wav_to_aligner",
                    final_output=True,
                    final_output_type="timestamps",
                ),
            ],
        }
    )


def req(
    rid: str = "r1", modalities: tuple[str, ...] | None = ("text", "audio"), **kw: Any
) -> PipelineRequest:
    kw.setdefault("prompt_token_ids", list(PROMPT))
    return PipelineRequest(request_id=rid, modalities=modalities, **kw)


def out(rid: str, stage: int, *, finished: bool = False, **kw: Any) -> StageOutput:
    return StageOutput(request_id=rid, stage_id=stage, finished=finished, **kw)


def of(actions: list[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def submits(actions: list[Action]) -> dict[int, StageSubmit]:
    return {a.stage_id: a for a in of(actions, StageSubmit)}


def client(actions: list[Action]) -> list[RequestOutput]:
    return [a.output for a in of(actions, ClientOutput)]


def released(actions: list[Action], rid: str) -> list[int]:
    return sorted(a.stage_id for a in of(actions, StageRelease) if a.request_id == rid)


def aborted(actions: list[Action], rid: str) -> list[int]:
    return sorted(a.stage_id for a in of(actions, StageAbort) if a.request_id == rid)


def assert_router_empty(router: Router) -> None:
    assert router.num_requests == 0, router.request_ids()
    for s in range(router.config.num_stages):
        assert router.num_requests_on(s) == 0


# ---------------------------------------------------------------------- planning (§2.2)


def test_plan_final_outputs_from_modalities() -> None:
    r = Router(omni())
    p = r.plan(["text"])
    assert (p.final_output_stage_ids, p.final_stage_id, p.prewarm_stage_ids) == ((0,), 0, ())
    p = r.plan(["text", "audio"])
    assert (p.final_output_stage_ids, p.final_stage_id, p.prewarm_stage_ids) == ((0, 2), 2, (1, 2))
    p = r.plan(["audio"])
    assert (p.final_output_stage_ids, p.final_stage_id) == ((2,), 2)
    # unknown modalities are ignored; none left -> every final output
    assert r.plan(["video"]).final_output_stage_ids == (0, 2)
    assert r.plan(None).final_output_stage_ids == (0, 2)


def test_plan_prewarms_only_chunk_receiving_stages() -> None:
    p = Router(tts_aligner()).plan(["audio", "timestamps"])
    assert p.final_output_stage_ids == (1, 2)
    assert p.prewarm_stage_ids == (1,)  # the aligner gets its input by forwarding


def test_plan_chunking_off_prewarms_nothing() -> None:
    p = Router(omni().with_async_chunk(False)).plan(["text", "audio"])
    assert p.prewarm_stage_ids == ()


# ---------------------------------------------------------------- admission (§2.3)


def test_admit_submits_stage0_and_placeholders() -> None:
    r = Router(omni())
    acts = r.admit(req(sampling={0: SamplingParams(max_tokens=3)}))
    subs = submits(acts)
    assert sorted(subs) == [0, 1, 2]
    first = subs[0].request
    assert first.prompt_token_ids == PROMPT and not first.is_placeholder
    assert first.sampling.max_tokens == 3 and first.final_stage_id == 2
    n = placeholder_prompt_len(PROMPT)
    assert n == 5 + 9
    for s in (1, 2):
        ph = subs[s].request
        assert ph.is_placeholder and ph.prompt_token_ids == [0] * n
        assert ph.request_id == "r1" and ph.final_stage_id == 2
    # stage 1 gets its config's sampling defaults
    assert subs[1].request.sampling == SamplingParams(max_tokens=7, seed=42)
    assert of(acts, ClientOutput) == []
    assert r.holders("r1") == [0, 1, 2]


def test_admit_placeholder_length_override() -> None:
    cfg = parse_pipeline(
        {
            "name": "omni",
            "stages": [
                _stage(0, "thinker", chunk_processor="c0", final_output=True, final_output_type="text"),
                _stage(1, "talker", chunk_processor="c1", async_chunk_prewarm_prompt_len=33),
                _stage(
                    2, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"
                ),
            ],
        }
    )
    subs = submits(Router(cfg).admit(req()))
    assert len(subs[1].request.prompt_token_ids) == 33


def test_text_only_submits_stage0_only() -> None:
    r = Router(omni())
    acts = r.admit(req(modalities=("text",)))
    assert sorted(submits(acts)) == [0]
    assert submits(acts)[0].request.final_stage_id == 0


def test_embeds_only_prompt_is_a_client_error_when_prewarm_is_needed() -> None:
    r = Router(omni())
    with pytest.raises(InvalidRequestError, match="prewarm"):
        r.admit(req(prompt_token_ids=None, inputs={"embeds": torch.zeros(2, 4)}))
    assert_router_empty(r)
    # no prewarm needed (text only): fine
    acts = r.admit(req(modalities=("text",), prompt_token_ids=None, inputs={"embeds": torch.zeros(2, 4)}))
    assert submits(acts)[0].request.prompt_token_ids == []
    r.abort("r1")
    with pytest.raises(InvalidRequestError, match="no prompt"):
        r.admit(req(prompt_token_ids=None))


def test_duplicate_admission_is_refused() -> None:
    r = Router(omni())
    r.admit(req())
    with pytest.raises(InvalidRequestError, match="already in flight"):
        r.admit(req())
    r.abort("r1")
    assert_router_empty(r)


# ------------------------------------------------------- routing and completion (§2.4, §2.6)


def test_completion_only_when_every_requested_final_output_finished() -> None:
    r = Router(omni())
    r.admit(req())
    acts = r.on_output(out("r1", 0, token_ids=[5]))
    assert [(o.stage_id, o.token_ids, o.finished) for o in client(acts)] == [(0, [5], False)]
    acts = r.on_output(out("r1", 0, finished=True, token_ids=[6], finish_reason="stop"))
    (o,) = client(acts)
    assert o.stage_finished and not o.finished and o.modality == "text"  # audio still owed
    assert of(acts, StageRelease) == []
    assert r.on_output(out("r1", 1, token_ids=[9])) == []  # intermediate stage: nothing for the client
    acts = r.on_output(out("r1", 2, audio=torch.ones(4), sample_rate=24000))
    assert [o.finished for o in client(acts)] == [False]
    acts = r.on_output(out("r1", 1, finished=True))
    assert client(acts) == [] and of(acts, StageRelease) == []
    acts = r.on_output(out("r1", 2, finished=True, audio=torch.ones(2), finish_reason="stop"))
    (last,) = client(acts)
    assert last.finished and last.modality == "audio" and last.finish_reason == "stop"
    assert released(acts, "r1") == [0, 1, 2]
    assert aborted(acts, "r1") == []
    assert_router_empty(r)


def test_hold_rule_waits_for_upstream_terminal() -> None:
    """Code2Wav finishes before the Talker's terminal output is routed (§2.4 step 3)."""
    r = Router(omni())
    r.admit(req())
    r.on_output(out("r1", 0, finished=True, token_ids=[1]))
    acts = r.on_output(out("r1", 2, finished=True, audio=torch.ones(3)))
    assert client(acts) == [] and of(acts, StageRelease) == []  # held
    assert "r1" in r
    acts = r.on_output(out("r1", 1, finished=True))
    (held,) = client(acts)
    assert held.finished and held.stage_id == 2 and held.audio is not None
    assert released(acts, "r1") == [0, 1, 2]
    assert_router_empty(r)


def test_hold_rule_waits_for_stage0_when_text_not_requested() -> None:
    r = Router(omni())
    r.admit(req(modalities=("audio",)))
    r.on_output(out("r1", 1, finished=True))
    acts = r.on_output(out("r1", 2, finished=True, audio=torch.ones(3)))
    assert client(acts) == []
    acts = r.on_output(out("r1", 0, finished=True, token_ids=[1]))  # text not requested: not shown
    (held,) = client(acts)
    assert held.stage_id == 2 and held.finished
    assert_router_empty(r)


def test_text_only_request_is_released_in_every_stage() -> None:
    r = Router(omni())
    r.admit(req(modalities=("text",)))
    acts = r.on_output(out("r1", 0, finished=True, token_ids=[3], finish_reason="length"))
    (o,) = client(acts)
    assert o.finished and o.finish_reason == "length"
    assert released(acts, "r1") == [0, 1, 2]  # stages 1 and 2 never saw it: release anyway
    assert_router_empty(r)


# -------------------------------------------------------------- forwarding (§2.5)


def test_non_chunk_stage_gets_its_input_only_after_its_source_finished() -> None:
    calls: list[SourceOutput] = []

    def builder(source: SourceOutput, request: PipelineRequest, stage: StageConfig) -> ForwardedInput:
        calls.append(source)
        return ForwardedInput(prompt_token_ids=[7, 7], inputs={"n": len(source.audio)})

    r = Router(tts_aligner(), input_builders={2: builder})
    acts = r.admit(req(modalities=("audio", "timestamps")))
    assert sorted(submits(acts)) == [0, 1]
    acts = r.on_output(out("r1", 1, audio=torch.ones(5), sample_rate=24000))
    assert 2 not in submits(acts) and calls == []
    assert [o.stage_id for o in client(acts)] == [1]
    acts = r.on_output(out("r1", 0, finished=True))
    assert 2 not in submits(acts)
    acts = r.on_output(out("r1", 1, finished=True, audio=torch.ones(3), sample_rate=24000))
    sub = submits(acts)[2].request
    assert sub.prompt_token_ids == [7, 7] and sub.inputs == {"n": 2} and not sub.is_placeholder
    (src,) = calls
    assert src.stage_id == 1 and src.finished and src.sample_rate == 24000
    assert torch.cat(src.audio).numel() == 8
    assert [o.finished for o in client(acts)] == [False]  # timestamps still owed
    acts = r.on_output(out("r1", 2, finished=True, token_ids=[1, 2]))
    (last,) = client(acts)
    assert last.finished and last.modality == "timestamps"
    assert released(acts, "r1") == [0, 1, 2]
    assert_router_empty(r)


def test_chunking_off_forwards_every_edge_in_order() -> None:
    r = Router(omni().with_async_chunk(False))
    acts = r.admit(req())
    assert sorted(submits(acts)) == [0]
    acts = r.on_output(out("r1", 0, finished=True, token_ids=[4, 5], text="hi"))
    sub1 = submits(acts)[1].request
    assert sub1.prompt_token_ids == [4, 5] and sub1.inputs["text"] == "hi"
    acts = r.on_output(out("r1", 1, finished=True, token_ids=[8]))
    assert submits(acts)[2].request.prompt_token_ids == [8]
    acts = r.on_output(out("r1", 2, finished=True, audio=torch.ones(2)))
    assert client(acts)[-1].finished
    assert_router_empty(r)


def test_builder_returning_nothing_ends_with_an_empty_terminal() -> None:
    r = Router(tts_aligner(), input_builders={2: lambda source, request, stage: None})
    r.admit(req(modalities=("audio", "timestamps")))
    r.on_output(out("r1", 0, finished=True))
    acts = r.on_output(out("r1", 1, finished=True, audio=torch.zeros(0), sample_rate=24000))
    assert 2 not in submits(acts)
    outs = client(acts)
    assert [(o.stage_id, o.stage_finished, o.finished) for o in outs] == [(1, True, False), (2, True, True)]
    assert outs[-1].modality == "timestamps"
    assert released(acts, "r1") == [0, 1, 2]
    assert_router_empty(r)


def test_empty_terminal_for_audio_is_an_empty_waveform() -> None:
    r = Router(omni().with_async_chunk(False), input_builders={2: lambda source, request, stage: None})
    r.admit(req(modalities=("audio",)))
    r.on_output(out("r1", 0, finished=True, token_ids=[1]))
    acts = r.on_output(out("r1", 1, finished=True))
    (o,) = client(acts)
    assert o.finished and o.stage_id == 2 and o.audio is not None and o.audio.numel() == 0
    assert_router_empty(r)


def test_builder_error_fails_only_that_request() -> None:
    def broken(source: SourceOutput, request: PipelineRequest, stage: StageConfig) -> ForwardedInput:
        raise KeyError("boom")

    r = Router(tts_aligner(), input_builders={2: broken})
    r.admit(req("a", modalities=("audio", "timestamps")))
    r.admit(req("b", modalities=("audio",)))
    r.on_output(out("a", 0, finished=True))
    acts = r.on_output(out("a", 1, finished=True, audio=torch.ones(1)))
    (o,) = [x for x in client(acts) if x.finished]
    assert o.finish_reason == "error" and "stage 2 (aligner)" in (o.error or "") and "boom" in (o.error or "")
    assert "b" in r and "a" not in r
    r.abort("b")
    assert_router_empty(r)


def test_default_input_builder() -> None:
    stage = omni().stage(1)
    src = SourceOutput(stage_id=0, token_ids=[], text="", audio=[], sample_rate=None, finished=True)
    assert default_input_builder(src, req(), stage) is None
    src = SourceOutput(
        stage_id=0,
        token_ids=[],
        text="",
        audio=[torch.ones(2), torch.ones(3)],
        sample_rate=8000,
        finished=True,
    )
    built = default_input_builder(src, req(), stage)
    assert built is not None and built.prompt_token_ids == [0]
    assert built.inputs["audio"].numel() == 5 and built.inputs["sample_rate"] == 8000


# ----------------------------------------------------------------- abort (§2.7, §2.8)


def test_abort_fans_out_to_every_holder_and_releases_everywhere() -> None:
    r = Router(omni())
    r.admit(req())
    acts = r.abort("r1")
    assert aborted(acts, "r1") == [0, 1, 2]
    assert released(acts, "r1") == [0, 1, 2]
    (o,) = client(acts)
    assert o.finished and o.finish_reason == "abort"
    # abort messages go before the releases (a stage drops the request, then its objects)
    kinds = [type(a).__name__ for a in acts if isinstance(a, StageAbort | StageRelease)]
    assert kinds == ["StageAbort"] * 3 + ["StageRelease"] * 3
    assert r.abort("r1") == []  # idempotent
    assert r.on_output(out("r1", 2, audio=torch.ones(1))) == []  # late output dropped
    assert r.num_dropped_outputs == 1
    assert_router_empty(r)


def test_abort_skips_stages_that_finished() -> None:
    r = Router(omni())
    r.admit(req())
    r.on_output(out("r1", 0, finished=True, token_ids=[1]))
    acts = r.abort("r1")
    assert aborted(acts, "r1") == [1, 2]
    assert released(acts, "r1") == [0, 1, 2]
    assert_router_empty(r)


def test_abort_while_held_delivers_the_held_content_first() -> None:
    r = Router(omni())
    r.admit(req())
    r.on_output(out("r1", 0, finished=True))
    r.on_output(out("r1", 2, finished=True, audio=torch.ones(3)))
    acts = r.abort("r1")
    outs = client(acts)
    assert [(o.stage_id, o.finished, o.finish_reason) for o in outs] == [(2, False, None), (2, True, "abort")]
    assert outs[0].audio is not None
    assert aborted(acts, "r1") == [1]
    assert_router_empty(r)


# ---------------------------------------------------------- failures (§10.7), dead stages


@pytest.mark.parametrize("kw", [{"error": "cuda oom"}, {"finish_reason": "error"}])
def test_an_error_in_any_stage_fails_the_request_fast(kw: dict[str, Any]) -> None:
    r = Router(omni())
    r.admit(req())
    r.on_output(out("r1", 0, token_ids=[1]))
    acts = r.on_output(out("r1", 1, finished=True, **kw))
    (o,) = client(acts)
    assert o.finished and o.finish_reason == "error" and o.stage_id == 1
    assert "stage 1 (talker)" in (o.error or "")
    if "error" in kw:
        assert "cuda oom" in (o.error or "")
    assert aborted(acts, "r1") == [0, 2]
    assert released(acts, "r1") == [0, 1, 2]
    assert_router_empty(r)


def test_an_abort_the_orchestrator_did_not_ask_for_fails_the_request() -> None:
    r = Router(omni())
    r.admit(req())
    acts = r.on_output(out("r1", 1, finished=True, finish_reason="abort"))
    (o,) = client(acts)
    assert o.finish_reason == "error" and "stage 1 (talker) aborted the request on its own" in (o.error or "")
    assert aborted(acts, "r1") == [0, 2]
    assert_router_empty(r)


def test_output_after_finish_fails_the_request() -> None:
    r = Router(omni())
    r.admit(req())
    r.on_output(out("r1", 1, finished=True))
    acts = r.on_output(out("r1", 1, token_ids=[1]))
    assert "after it finished" in (client(acts)[0].error or "")
    assert_router_empty(r)


def test_output_from_a_stage_never_given_the_request_fails_it() -> None:
    r = Router(omni())
    r.admit(req(modalities=("text",)))
    acts = r.on_output(out("r1", 2, audio=torch.ones(1)))
    assert client(acts)[0].finish_reason == "error"
    assert_router_empty(r)


def test_dead_stage_fails_the_requests_that_need_it() -> None:
    r = Router(omni())
    r.admit(req("av"))
    r.admit(req("t", modalities=("text",)))
    acts = r.on_stage_died(1, "stage 1 (talker) worker process (pid 7) died (killed by SIGKILL)")
    (o,) = client(acts)
    assert o.request_id == "av" and "SIGKILL" in (o.error or "") and o.stage_id == 1
    assert aborted(acts, "av") == [0, 1, 2] and released(acts, "av") == [0, 1, 2]
    assert "t" in r  # text-only does not need stage 1
    # a new request that needs the dead stage fails at once
    acts = r.admit(req("later"))
    assert submits(acts) == {} and client(acts)[0].finish_reason == "error"
    acts = r.on_output(out("t", 0, finished=True))
    assert client(acts)[0].finished
    assert_router_empty(r)


def test_dead_stage_does_not_fail_a_request_it_already_finished() -> None:
    r = Router(omni())
    r.admit(req())
    r.on_output(out("r1", 0, finished=True))
    r.on_output(out("r1", 2, finished=True, audio=torch.ones(1)))  # held: stage 1 owes its terminal
    assert r.on_stage_died(2, "gone") == []
    acts = r.on_output(out("r1", 1, finished=True))
    assert client(acts)[0].finished
    assert_router_empty(r)


def test_a_dead_producer_fails_a_request_whose_consumer_still_reads_its_chunks() -> None:
    # The Thinker finished, the Talker still reads its chunks: the sweep after the
    # Thinker's death reclaims the unread ones, so the request cannot go on.
    r = Router(omni())
    r.admit(req("av"))
    r.on_output(out("av", 0, finished=True))
    acts = r.on_stage_died(0, "stage 0 (thinker) died", retry_after_s=2.5)
    (o,) = client(acts)
    assert o.error_code == "stage_unavailable" and o.retry_after_s == 2.5 and o.stage_id == 0
    assert aborted(acts, "av") == [1, 2] and released(acts, "av") == [0, 1, 2]
    assert_router_empty(r)


def test_a_down_stage_refuses_admissions_with_its_retry_after_until_it_is_back() -> None:
    r = Router(omni())
    r.on_stage_died(2, "stage 2 (code2wav) died", retry_after_s=3.0)
    r.set_unavailable(2, "stage 2 (code2wav) is restarting", 1.0)
    (o,) = client(r.admit(req("a")))
    assert (o.error_code, o.retry_after_s, o.error) == (
        "stage_unavailable",
        1.0,
        "stage 2 (code2wav) is restarting",
    )
    assert r.dead_stages() == {2: "stage 2 (code2wav) is restarting"}
    assert 0 in submits(r.admit(req("t", modalities=("text",))))  # text-only: served
    r.on_stage_back(2)
    assert sorted(submits(r.admit(req("b")))) == [0, 1, 2]
    assert r.dead_stages() == {}


def test_fail_all() -> None:
    r = Router(omni())
    for i in range(3):
        r.admit(req(f"r{i}"))
    acts = r.fail_all("shutting down")
    assert [o.finish_reason for o in client(acts)] == ["error"] * 3
    assert_router_empty(r)


# ---------------------------------------------------------------------------- helpers


def test_requested_modalities_and_sampling_defaults() -> None:
    assert requested_modalities(None) is None
    assert requested_modalities("text") == ("text",)
    assert requested_modalities(["text", "audio"]) == ("text", "audio")
    with pytest.raises(InvalidRequestError):
        requested_modalities([1, 2])  # type: ignore[list-item]
    cfg = omni()
    assert stage_sampling_defaults(cfg.stage(1)) == SamplingParams(max_tokens=7, seed=42)
    assert stage_sampling_defaults(cfg.stage(0)) == SamplingParams()


def test_a_chat_answers_text_reaches_the_aligner_once_the_answer_is_whole() -> None:
    """Thinker (text) -> voice (audio, chunks) -> aligner (complete input): the aligner's
    source carries the Thinker's whole answer (what the voice spoke), and it is forwarded
    only once the Thinker's last output was routed too, even when the voice finished first."""
    cfg = parse_pipeline(
        {
            "name": "voice",
            "stages": [
                _stage(0, "thinker", chunk_processor="c0", final_output=True, final_output_type="text"),
                _stage(1, "voice", execution_type="generation", final_output=True, final_output_type="audio"),
                _stage(
                    2,
                    "aligner",
                    execution_type="generation",
                    async_chunk=False,
                    input_builder="code2wav_to_aligner",
                    final_output=True,
                    final_output_type="timestamps",
                ),
            ],
        }
    )
    seen: list[SourceOutput] = []

    def builder(source: SourceOutput, request: PipelineRequest, stage: StageConfig) -> ForwardedInput:
        seen.append(source)
        return ForwardedInput(prompt_token_ids=[1])

    r = Router(cfg, input_builders={2: builder})
    r.admit(req("a", modalities=("text", "audio", "timestamps")))
    r.on_output(out("a", 0, text="Paris is "))
    r.on_output(out("a", 1, audio=torch.ones(4)))
    acts = r.on_output(out("a", 1, finished=True, audio=torch.ones(2), finish_reason="stop"))
    assert 2 not in submits(acts) and seen == []  # the Thinker's last words are not in yet
    acts = r.on_output(out("a", 0, finished=True, text="the capital.", finish_reason="stop"))
    assert 2 in submits(acts)
    (source,) = seen
    assert source.stage_id == 1 and source.answer_text == "Paris is the capital."
    acts = r.on_output(out("a", 2, finished=True, text="[]", finish_reason="stop"))
    assert client(acts)[-1].finished and "a" not in r
