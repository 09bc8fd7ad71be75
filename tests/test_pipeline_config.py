"""omnirelay.pipeline: typed config, async_chunk resolution, edge validation (docs/protocol.md §1, §2.2, §2.3)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

import omnirelay.pipeline as pipeline_pkg
from omnirelay.errors import ConfigError, PipelineConfigError
from omnirelay.pipeline import (
    ComponentRegistry,
    ConnectorRole,
    EdgeContract,
    ExecutionType,
    FinalOutputType,
    FlagOrigin,
    PipelineConfig,
    PipelineConfigWarning,
    Registry,
    load_pipeline,
    parse_pipeline,
    placeholder_prompt_len,
    resolve_stage_async_chunk,
    shipped_pipeline_names,
)
from omnirelay.pipeline.config import DeviceGroups
from omnirelay.pipeline.parse import PIPELINE_KEYS, SAMPLING_KEYS, STAGE_KEYS
from omnirelay.pipeline.validate import NAMESPACE_PATTERN

SHIPPED = ("qwen3-omni", "qwen3-omni-tiny", "qwen3-tts", "qwen3-tts-0.6b", "qwen3-tts-tiny")
EXECUTOR_NAMES = (
    "qwen3_omni.thinker",
    "qwen3_omni.talker",
    "qwen3_omni.code2wav",
    "qwen3_tts.talker",
    "qwen3_tts.code2wav",
    "aligner.vad",
    "aligner.pocketsphinx",
)
PROCESSOR_NAMES = ("thinker_to_talker", "talker_to_code2wav", "code2wav_to_aligner")

# ---------------------------------------------------------------------------------------
# builders of in-memory pipelines


def _stage(sid: int, name: str, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": sid, "name": name, "execution_type": "ar", "executor": f"fake.{name}"}
    if sid > 0:
        out["input_sources"] = [sid - 1]
    out.update(kw)
    return out


def _omni(flags: tuple[Any, Any, Any] = (None, None, None), **top: Any) -> dict[str, Any]:
    """Thinker -> Talker -> Code2Wav; the first two declare chunk producers."""
    stages = [
        _stage(
            0, "thinker", chunk_processor="thinker_to_talker", final_output=True, final_output_type="text"
        ),
        _stage(1, "talker", chunk_processor="talker_to_code2wav", input_builder="thinker_to_talker"),
        _stage(
            2,
            "code2wav",
            execution_type="generation",
            input_builder="talker_to_code2wav",
            final_output=True,
            final_output_type="audio",
        ),
    ]
    for st, flag in zip(stages, flags):
        if flag is not None:
            st["async_chunk"] = flag
    return {"name": "omni", "stages": stages, **top}


def _tts(aligner_flag: Any = False, **top: Any) -> dict[str, Any]:
    """Talker -> Code2Wav (chunked) -> aligner (complete waveform)."""
    aligner = _stage(
        2,
        "aligner",
        execution_type="generation",
        input_builder="code2wav_to_aligner",
        final_output=True,
        final_output_type="timestamps",
    )
    if aligner_flag is not None:
        aligner["async_chunk"] = aligner_flag
    return {
        "name": "tts",
        "stages": [
            _stage(0, "talker", chunk_processor="talker_to_code2wav"),
            _stage(1, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"),
            aligner,
        ],
        **top,
    }


def _load_text(tmp_path: Path, text: str, name: str = "pipe.yaml", **kw: Any) -> PipelineConfig:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return load_pipeline(path, **kw)


def _error(data: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(PipelineConfigError) as info:
        parse_pipeline(data, source="pipe.yaml", **kw)
    return str(info.value)


# ---------------------------------------------------------------------------------------
# docs/protocol.md §1.2: the resolver table


@pytest.mark.parametrize(
    ("pipeline_flag", "stage_value", "expected"),
    [
        (False, None, False),
        (False, False, False),
        (False, True, False),  # a stage can never turn it on
        (True, None, True),
        (True, True, True),
        (True, False, False),  # opt-out
    ],
)
def test_resolver_table(pipeline_flag: bool, stage_value: bool | None, expected: bool) -> None:
    assert resolve_stage_async_chunk(pipeline_flag, stage_value, num_stages=3) is expected


@pytest.mark.parametrize("stage_value", [None, True, False])
def test_single_stage_forces_chunking_off(stage_value: bool | None) -> None:
    assert resolve_stage_async_chunk(True, stage_value, num_stages=1) is False
    data = {
        "name": "one",
        "async_chunk": True,
        "stages": [_stage(0, "lm", final_output=True, final_output_type="text", async_chunk=stage_value)],
    }
    cfg = parse_pipeline(data)
    assert cfg.resolved_async_chunk(0) is False
    assert cfg.any_stage_chunks() is False
    assert cfg.edges() == ()


# ---------------------------------------------------------------------------------------
# docs/protocol.md §8 item 10: the config matrix


@pytest.mark.parametrize(
    ("pipeline_flag", "flags", "expected"),
    [
        (True, (None, None, None), [True, True, True]),
        (True, (True, None, True), [True, True, True]),
        (True, (False, False, False), [False, False, False]),
        (False, (None, None, None), [False, False, False]),
        (False, (True, True, True), [False, False, False]),
        (False, (False, None, True), [False, False, False]),
        (None, (None, None, None), [True, True, True]),  # the pipeline default is on
    ],
)
def test_matrix_resolves(
    pipeline_flag: bool | None, flags: tuple[Any, Any, Any], expected: list[bool]
) -> None:
    top = {} if pipeline_flag is None else {"async_chunk": pipeline_flag}
    cfg = parse_pipeline(_omni(flags, **top))
    assert [cfg.resolved_async_chunk(s) for s in cfg.stages] == expected
    assert cfg.any_stage_chunks() is any(expected)
    contract = EdgeContract.CHUNKS if all(expected) else EdgeContract.COMPLETE_INPUT
    assert [e.contract for e in cfg.edges()] == [contract, contract]
    # One resolver feeds every consumer: processor choice and receive predicate agree with it.
    for s in cfg.stages:
        on = cfg.resolved_async_chunk(s)
        assert cfg.stage_receives_chunks(s) is (on and s.id > 0)
        assert cfg.next_stage_processor(s) == (s.chunk_processor if on else s.full_processor)


@pytest.mark.parametrize(
    ("flags", "edge"),
    [
        ((None, False, None), "edge 0 -> 1 (thinker -> talker)"),
        ((None, None, False), "edge 1 -> 2 (talker -> code2wav)"),
        ((False, None, None), "edge 0 -> 1 (thinker -> talker)"),
        ((True, False, True), "edge 0 -> 1 (thinker -> talker)"),
    ],
)
def test_mismatch_on_a_producer_edge_fails_naming_the_edge(flags: tuple[Any, Any, Any], edge: str) -> None:
    msg = _error(_omni(flags))
    assert msg.startswith(f"pipe.yaml, {edge}, key 'async_chunk'")
    assert "declares chunk_processor" in msg
    assert "Fix:" in msg


def test_override_replaces_the_pipeline_flag_before_validation() -> None:
    data = _omni((None, False, None), async_chunk=True)
    _error(data)  # invalid as written
    cfg = parse_pipeline(data, async_chunk_override=False)
    assert cfg.async_chunk is False
    assert cfg.async_chunk_origin is FlagOrigin.OVERRIDE
    assert not cfg.any_stage_chunks()
    on = parse_pipeline(_omni(), async_chunk_override=True)
    assert on.async_chunk_origin is FlagOrigin.OVERRIDE and on.any_stage_chunks()
    assert parse_pipeline(_omni(async_chunk=True)).async_chunk_origin is FlagOrigin.FILE
    assert parse_pipeline(_omni()).async_chunk_origin is FlagOrigin.DEFAULT
    with pytest.raises(ConfigError):
        parse_pipeline(_omni(), async_chunk_override="false")  # type: ignore[arg-type]


def test_with_async_chunk_returns_a_validated_copy() -> None:
    cfg = parse_pipeline(_omni())
    off = cfg.with_async_chunk(False)
    assert off.async_chunk is False and cfg.async_chunk is True
    assert not off.any_stage_chunks()
    bad = parse_pipeline(_omni((None, False, None)), async_chunk_override=False)
    with pytest.raises(PipelineConfigError, match="edge 0 -> 1"):
        bad.with_async_chunk(True)


def _false_true_true(*, sender_role: bool) -> dict[str, Any]:
    talker: dict[str, Any] = {"async_chunk": True, "chunk_processor": "talker_to_code2wav"}
    if sender_role:
        talker["connector_role"] = "sender"
    return {
        "name": "ftt",
        "async_chunk": True,
        "stages": [
            _stage(
                0,
                "thinker",
                async_chunk=False,
                full_processor="thinker_full",
                final_output=True,
                final_output_type="text",
            ),
            _stage(1, "talker", input_builder="thinker_to_talker", **talker),
            _stage(
                2,
                "code2wav",
                execution_type="generation",
                async_chunk=True,
                final_output=True,
                final_output_type="audio",
            ),
        ],
    }


def test_false_true_true_still_enables_chunk_orchestration() -> None:
    """docs/protocol.md §1.4: the global flag is any(resolved), never stage 0's value."""
    cfg = parse_pipeline(_false_true_true(sender_role=True))
    assert [cfg.resolved_async_chunk(s) for s in cfg.stages] == [False, True, True]
    assert cfg.any_stage_chunks() is True
    assert [cfg.stage_receives_chunks(i) for i in range(3)] == [False, False, True]
    assert cfg.edge_contract(0, 1) is EdgeContract.COMPLETE_INPUT
    assert cfg.edge_contract(1, 2) is EdgeContract.CHUNKS
    assert cfg.next_stage_processor(0) == "thinker_full"  # resolved off: the full producer
    assert cfg.next_stage_processor(1) == "talker_to_code2wav"
    e01, e12 = cfg.edges()
    assert e01.input_builder == "thinker_to_talker" and e12.input_builder is None


def test_stage_waiting_for_chunks_that_no_source_sends_fails() -> None:
    """Beyond §1.3: a chunk-receiving stage whose source has no chunk producer would hang."""
    msg = _error(_false_true_true(sender_role=False))
    assert msg.startswith("pipe.yaml, edge 0 -> 1 (thinker -> talker), key 'async_chunk'")
    assert "would wait for chunks" in msg and "declares no chunk_processor" in msg


def test_aligner_edge_is_free() -> None:
    """docs/protocol.md §1.3: Code2Wav declares no chunk producer, so 1 -> 2 may mix modes."""
    cfg = parse_pipeline(_tts(aligner_flag=False))
    assert [cfg.resolved_async_chunk(s) for s in cfg.stages] == [True, True, False]
    assert cfg.edge_contract(0, 1) is EdgeContract.CHUNKS
    assert cfg.edge_contract(1, 2) is EdgeContract.COMPLETE_INPUT
    assert cfg.stage_receives_chunks(1) is True
    assert cfg.stage_receives_chunks(2) is False  # never prewarmed; forwarded after audio finishes
    assert cfg.stage_input_builder(2) == "code2wav_to_aligner"
    assert cfg.any_stage_chunks() is True


def test_aligner_left_in_chunk_mode_fails_instead_of_hanging() -> None:
    msg = _error(_tts(aligner_flag=None))
    assert "edge 1 -> 2 (code2wav -> aligner)" in msg
    assert "set async_chunk: false on stage 2 (aligner)" in msg


def test_chunk_edge_into_a_sender_only_stage_fails() -> None:
    data = _omni()
    data["stages"][2]["connector_role"] = "sender"
    msg = _error(data)
    assert "edge 1 -> 2 (talker -> code2wav), key 'connector_role'" in msg


def test_flag_on_with_edges_but_no_chunk_producer_fails() -> None:
    data = _omni()
    for st in data["stages"]:
        st.pop("chunk_processor", None)
    data["stages"][0]["full_processor"] = "thinker_full"  # a full producer does not count
    msg = _error(data)
    assert msg.startswith("pipe.yaml, key 'async_chunk'") and "no stage declares a chunk_processor" in msg
    cfg = parse_pipeline({**data, "async_chunk": False})
    assert not cfg.any_stage_chunks()


def test_processor_selection_and_sync_input_builder() -> None:
    """docs/protocol.md §1.6."""
    data = _omni()
    data["stages"][1]["sync_input_builder"] = "talker_tokens_only"
    data["stages"][1]["full_processor"] = "talker_full"
    on = parse_pipeline(data)
    assert on.next_stage_processor(1) == "talker_to_code2wav"
    assert on.stage_input_builder(1) == "thinker_to_talker"
    off = parse_pipeline(data, async_chunk_override=False)
    assert off.next_stage_processor(1) == "talker_full"
    assert off.stage_input_builder(1) == "talker_tokens_only"
    assert off.edges()[0].input_builder == "talker_tokens_only"


def test_stage_lookup_and_edges() -> None:
    cfg = parse_pipeline(_omni())
    assert cfg.num_stages == 3
    assert cfg.stage(1).name == "talker" and cfg.stage(cfg.stages[1]) is cfg.stages[1]
    assert cfg.consumer_ids(0) == (1,) and cfg.consumer_ids(2) == ()
    assert cfg.stages[1].label == "stage 1 (talker)"
    assert cfg.stages[2].execution_type is ExecutionType.GENERATION
    assert cfg.stage_receives_chunks(0) is False  # stage 0 never receives
    with pytest.raises(ConfigError, match="no stage 7"):
        cfg.stage(7)
    with pytest.raises(ConfigError, match="no edge 0 -> 2"):
        cfg.edge_contract(0, 2)
    assert [e.label for e in cfg.edges()] == ["0 -> 1", "1 -> 2"]


# ---------------------------------------------------------------------------------------
# strict types


@pytest.mark.parametrize("value", ["false", "true", "False", 0, 1, "yes", "no", 0.0, [False]])
def test_stage_async_chunk_rejects_non_bools(value: Any) -> None:
    msg = _error(_omni((None, value, None)))
    assert msg.startswith("pipe.yaml, stage 1 (talker), key 'async_chunk': expected true, false or null")
    assert "Fix: write async_chunk:" in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [("async_chunk", 1), ("async_chunk", "true"), ("async_chunk", None)],
)
def test_pipeline_async_chunk_is_a_strict_bool(key: str, value: Any) -> None:
    msg = _error(_omni(**{key: value}))
    assert msg.startswith("pipe.yaml, key 'async_chunk': expected true or false")


@pytest.mark.parametrize("key", ["final_output", "async_scheduling"])
@pytest.mark.parametrize("value", [1, 0, "yes", "true", None])
def test_stage_bools_are_strict(key: str, value: Any) -> None:
    data = _omni()
    data["stages"][2][key] = value
    msg = _error(data)
    assert msg.startswith(f"pipe.yaml, stage 2 (code2wav), key '{key}': expected true or false")


def test_yaml_yes_and_on_are_strings_not_booleans(tmp_path: Path) -> None:
    text = (
        "name: p\n"
        "stages:\n"
        "  - {id: 0, name: a, execution_type: ar, executor: x, chunk_processor: c, final_output: true, final_output_type: text}\n"
        "  - {id: 1, name: b, execution_type: ar, executor: y, input_sources: [0], async_chunk: yes}\n"
    )
    with pytest.raises(PipelineConfigError, match=r"stage 1 \(b\), key 'async_chunk': .*the string 'yes'"):
        _load_text(tmp_path, text)
    cfg = _load_text(tmp_path, text.replace("async_chunk: yes", "async_chunk: True"))
    assert cfg.stages[1].async_chunk is True


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("id", "0", "expected an int"),
        ("max_num_seqs", "64", "expected an int"),
        ("max_num_seqs", 0, "must be ≥ 1"),
        ("max_num_seqs", True, "expected an int"),
        ("max_num_batched_tokens", 0, "must be ≥ 1"),
        ("devices", 0, "expected a non-empty string"),
        ("execution_type", "LLM_AR", "expected one of ar, generation"),
        ("final_output_type", "video", "expected one of text, audio, timestamps"),
        ("connector_role", "both", "expected one of sender, receiver"),
        ("input_sources", "1", "expected a list of ints"),
        ("input_sources", [True], "expected a list of ints"),
        ("executor_args", ["tiny"], "expected a mapping"),
        ("executor", "", "expected a non-empty string"),
        ("async_chunk_prewarm_prompt_len", 1, "must be an int > 1"),
        ("async_chunk_prewarm_prompt_len", 2.5, "expected an int"),
        ("sampling", [], "expected a mapping"),
    ],
)
def test_stage_value_errors_name_file_stage_and_key(key: str, value: Any, expected: str) -> None:
    data = _omni()
    data["stages"][2][key] = value
    msg = _error(data)
    assert "pipe.yaml" in msg
    assert "(code2wav)" in msg and f"key '{key}'" in msg
    assert expected in msg
    assert "Fix:" in msg


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("temperature", "hot", "expected a number"),
        ("temperature", -0.5, "must be a finite number ≥ 0"),
        ("top_k", 0, "must be ≥ 1"),
        ("top_p", 1.5, "must be in (0, 1]"),
        ("seed", 1.0, "expected an int"),
        ("max_tokens", 0, "must be ≥ 1"),
        ("stop_token_ids", [2150.0], "expected a list of ints"),
        ("stop_token_ids", [-1], "must be ≥ 0"),
        ("stop_tokens", [2150], "unknown sampling key"),
    ],
)
def test_sampling_errors(key: str, value: Any, expected: str) -> None:
    data = _omni()
    data["stages"][1]["sampling"] = {key: value}
    msg = _error(data)
    assert f"stage 1 (talker), key 'sampling.{key}'" in msg
    assert expected in msg


def test_sampling_values_are_typed() -> None:
    data = _omni()
    data["stages"][1]["sampling"] = {
        "temperature": 1,
        "top_k": 50,
        "seed": 42,
        "max_tokens": 8,
        "stop_token_ids": [2150],
    }
    sp = parse_pipeline(data).stages[1].sampling
    assert sp.temperature == 1.0 and isinstance(sp.temperature, float)
    assert (sp.top_k, sp.seed, sp.max_tokens, sp.stop_token_ids) == (50, 42, 8, (2150,))


# ---------------------------------------------------------------------------------------
# unknown keys


def test_unknown_pipeline_key_suggests_the_right_one() -> None:
    msg = _error(_omni(asyn_chunk=False))
    assert msg.startswith("pipe.yaml, key 'asyn_chunk': unknown pipeline key")
    assert "did you mean 'async_chunk'?" in msg


def test_unknown_stage_key_names_stage_id_and_name() -> None:
    data = _omni()
    data["stages"][1]["async_chunks"] = False
    msg = _error(data)
    assert msg.startswith("pipe.yaml, stage 1 (talker), key 'async_chunks': unknown stage key")
    assert "did you mean 'async_chunk'?" in msg


def test_unknown_connector_key() -> None:
    msg = _error(_omni(connectors={"c": {"backend": "shm", "extras": {}}}))
    assert msg.startswith("pipe.yaml, connector 'c', key 'extras': unknown connector key")


def test_stage_label_when_id_is_broken() -> None:
    data = _omni()
    data["stages"][1]["id"] = "one"
    data["stages"][1]["bogus"] = 1
    msg = _error(data)
    assert msg.startswith("pipe.yaml, stages[1] (talker), key 'bogus'")


def test_key_tables_match_the_structs() -> None:
    derived = {"replica", "replica_devices", "replica_resources"}  # a worker's view, never in a file
    assert set(STAGE_KEYS) == set(pipeline_pkg.StageConfig.__struct_fields__) - derived
    assert set(SAMPLING_KEYS) == set(pipeline_pkg.SamplingConfig.__struct_fields__)
    internal = {"source", "async_chunk_origin"}
    assert set(PIPELINE_KEYS) == set(PipelineConfig.__struct_fields__) - internal


# ---------------------------------------------------------------------------------------
# docs/protocol.md §1.1 construction-time validation


def test_no_stages() -> None:
    assert "the pipeline has no stages" in _error({"name": "p", "stages": []})
    assert "key 'stages': the key is missing" in _error({"name": "p"})


def test_no_final_output() -> None:
    data = _omni()
    for st in data["stages"]:
        st.pop("final_output", None)
        st.pop("final_output_type", None)
    msg = _error(data)
    assert msg.startswith("pipe.yaml, key 'final_output': no stage has final_output: true")


def test_final_output_and_type_go_together() -> None:
    data = _omni()
    data["stages"][0].pop("final_output_type")
    assert "final_output is true but final_output_type is missing" in _error(data)
    data = _omni()
    data["stages"][1]["final_output_type"] = "audio"
    assert "stage 1 (talker), key 'final_output_type'" in _error(data)


def test_duplicate_ids() -> None:
    data = _omni()
    data["stages"][2]["id"] = 1
    msg = _error(data)
    assert "stages[2] = stage 1 (code2wav), key 'id'" in msg
    assert "already used by stages[1] = stage 1 (talker)" in msg


def test_ids_in_list_order() -> None:
    data = _omni()
    data["stages"][0]["id"] = 5
    assert "stage ids must be 0, 1, 2" in _error(data)


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ([7], "source 7 is not a stage of this pipeline"),
        ([1], "the stage lists itself as an input source"),
        ([0, 0], "source 0 is listed twice"),
        ([], "pipelines are linear"),
    ],
)
def test_bad_sources(sources: list[int], expected: str) -> None:
    data = _omni()
    data["stages"][1]["input_sources"] = sources
    msg = _error(data)
    assert "stage 1 (talker), key 'input_sources'" in msg or "key 'input_sources'" in msg
    assert expected in msg


def test_skip_edge_is_rejected_as_non_linear() -> None:
    data = _omni()
    data["stages"][2]["input_sources"] = [0]
    msg = _error(data)
    assert "stage 2 (code2wav), key 'input_sources'" in msg and "use input_sources: [1]" in msg


def test_no_entry_stage() -> None:
    data = _omni()
    data["stages"][0]["input_sources"] = [2]
    assert "no stage takes the client's request" in _error(data)


# ---------------------------------------------------------------------------------------
# connectors and namespace


def test_connectors_default_and_named() -> None:
    data = _omni(connectors={"codec": {"backend": "shm", "extra": {"codec_chunk_frames": 25}}})
    data["stages"][2]["connector"] = "codec"
    cfg = parse_pipeline(data)
    e01, e12 = cfg.edges()
    assert (e01.connector, e01.backend, e01.extra) == ("default", "shm", {})
    assert (e12.connector, e12.backend, e12.extra) == ("codec", "shm", {"codec_chunk_frames": 25})
    inproc = parse_pipeline(_omni(connectors={"default": {"backend": "inproc"}}))
    assert {e.backend for e in inproc.edges()} == {"inproc"}
    other = parse_pipeline(_omni(connectors={"c": {}}, default_connector="c"))
    assert {e.connector for e in other.edges()} == {"c"}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda d: d.update(connectors={"c": {"backend": "tcp"}}),
            "connector 'c', key 'backend': unknown backend 'tcp'",
        ),
        (
            lambda d: d["stages"][1].update(connector="nope"),
            "stage 1 (talker), key 'connector': no connector named 'nope'",
        ),
        (lambda d: d["stages"][0].update(connector="default"), "stage 0 (thinker), key 'connector'"),
        (lambda d: d.update(default_connector="nope"), "key 'default_connector'"),
        (lambda d: d.update(connectors=["shm"]), "key 'connectors': expected a mapping"),
        (
            lambda d: d.update(connectors={"c": {"extra": {1: 2}}}),
            "connector 'c', key 'extra': keys must be strings",
        ),
    ],
)
def test_connector_errors(mutate: Any, expected: str) -> None:
    data = _omni()
    mutate(data)
    assert expected in _error(data)


def test_namespace_rule_matches_the_connectors() -> None:
    from omnirelay.connectors.base import validate_namespace
    from omnirelay.errors import InvalidKeyError

    for ns in ["prod", "a.b_c", "x" * 48, "x" * 49, "", "-a", "a/b", "a-b", "ü"]:
        try:
            validate_namespace(ns)
            accepted = True
        except InvalidKeyError:
            accepted = False
        assert bool(NAMESPACE_PATTERN.match(ns)) is accepted, ns
    assert parse_pipeline(_omni(namespace="prod")).namespace == "prod"
    assert "key 'namespace'" in _error(_omni(namespace="a/b"))


# ---------------------------------------------------------------------------------------
# docs/protocol.md §4.10: input wait timeout


def test_timeout_default() -> None:
    assert parse_pipeline(_omni()).input_wait_timeout_s == 600.0
    assert parse_pipeline(_omni(input_wait_timeout_s=30)).input_wait_timeout_s == 30.0


def test_timeout_zero_disables_with_a_warning() -> None:
    with pytest.warns(PipelineConfigWarning, match="disables the input deadline"):
        cfg = parse_pipeline(_omni(input_wait_timeout_s=0), source="pipe.yaml")
    assert cfg.input_wait_timeout_s == 0
    assert issubclass(PipelineConfigWarning, pipeline_pkg.OmniRelayWarning)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (-1, "must be a finite number of seconds ≥ 0"),
        (math.inf, "must be a finite number of seconds ≥ 0"),
        (math.nan, "must be a finite number of seconds ≥ 0"),
        ("10m", "expected a number, got the string '10m'"),
        (True, "expected a number, got the boolean true"),
        (None, "expected a number, got null"),
    ],
)
def test_timeout_errors(value: Any, expected: str) -> None:
    msg = _error(_omni(input_wait_timeout_s=value))
    assert msg.startswith("pipe.yaml, key 'input_wait_timeout_s'") and expected in msg


def test_invalid_file_does_not_warn_about_timeout() -> None:
    # pytest turns warnings into errors: a file that fails must fail with its error only.
    data = _omni(input_wait_timeout_s=0)
    data["stages"][0]["bogus"] = 1
    with pytest.raises(PipelineConfigError, match="bogus"):
        parse_pipeline(data)


# ---------------------------------------------------------------------------------------
# docs/protocol.md §2.3: placeholder length

IM, SYS, USER, ASST = 151644, 8948, 872, 77091


def test_placeholder_constants() -> None:
    assert (pipeline_pkg.IM_START_TOKEN_ID, pipeline_pkg.SYSTEM_ROLE_TOKEN_ID) == (IM, SYS)
    assert (pipeline_pkg.USER_ROLE_TOKEN_ID, pipeline_pkg.ASSISTANT_ROLE_TOKEN_ID) == (USER, ASST)
    assert pipeline_pkg.ASSISTANT_TURN_EXTRA == 9


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([IM, USER, 10, 11, 12, 13, IM, ASST, 20, 21], 6 + 9),  # user span 6, open assistant turn +9
        ([IM, SYS, 1, 2, 3, IM, USER, 10, 11, IM, ASST], 4 + 9),  # system skipped
        ([IM, USER, 10, IM, ASST, 5, IM, USER, 7, 8], 3 + 4),  # last turn is a user turn: no +9
        ([IM, SYS, 1, 2], 1),  # nothing counted: at least 1
        ([], 1),
        ([5, 6, IM, USER, 1], 3),  # tokens before the first turn are not counted
        ([IM, USER, 1, 2, IM], 5),  # cut template (no role after the last start): prompt length
    ],
)
def test_placeholder_prompt_len(prompt: list[int], expected: int) -> None:
    assert placeholder_prompt_len(prompt) == expected


def test_placeholder_override() -> None:
    assert placeholder_prompt_len([IM, USER, 1], override=37) == 37
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError):
            placeholder_prompt_len([IM, USER, 1], override=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# docs/protocol.md §2.2: final outputs


@pytest.mark.parametrize(
    ("modalities", "ids", "final"),
    [
        (["text"], (0,), 0),
        (["text", "audio"], (0, 2), 2),
        (["audio"], (2,), 2),
        ("text", (0,), 0),
        (["text", "video"], (0,), 0),  # unknown modalities are ignored
        (["video"], (0, 2), 2),  # none left: all
        ([], (0, 2), 2),
        (None, (0, 2), 2),
    ],
)
def test_final_outputs_omni(modalities: Any, ids: tuple[int, ...], final: int) -> None:
    cfg = parse_pipeline(_omni())
    assert cfg.final_output_stage_ids(modalities) == ids
    assert cfg.final_stage_id(modalities) == final


def test_final_outputs_tts_with_timestamps() -> None:
    cfg = parse_pipeline(_tts())
    assert cfg.final_output_stage_ids(["audio", "timestamps"]) == (1, 2)
    assert cfg.final_stage_id(["audio", "timestamps"]) == 2
    assert cfg.final_output_stage_ids(["audio"]) == (1,)
    assert cfg.final_output_stage_ids(["timestamps"]) == (2,)
    assert cfg.stages[2].final_output_type is FinalOutputType.TIMESTAMPS


# ---------------------------------------------------------------------------------------
# registry


def _registry() -> ComponentRegistry:
    reg = ComponentRegistry()
    for name in EXECUTOR_NAMES:
        reg.executors.add(name, object())
    for name in PROCESSOR_NAMES:
        reg.processors.add(name, object())
    return reg


def test_registry_register_get_names() -> None:
    reg: Registry[Any] = Registry("executor")

    @reg.register("counting_lm")
    class CountingLM:
        pass

    assert reg.get("counting_lm") is CountingLM
    assert reg.names() == ("counting_lm",) and "counting_lm" in reg and len(reg) == 1
    with pytest.raises(
        ConfigError,
        match=r"unknown executor 'counting_l' \(did you mean 'counting_lm'\?\); known executors: counting_lm",
    ):
        reg.get("counting_l")
    with pytest.raises(ConfigError, match="already registered"):
        reg.add("counting_lm", object())
    replacement = object()
    assert reg.add("counting_lm", replacement, replace=True) is replacement
    with pytest.raises(ConfigError):
        reg.add("", object())


def test_registry_checks_names_only_when_given() -> None:
    data = _omni()
    parse_pipeline(data)  # fake.* executors: no registry, no check
    with pytest.raises(PipelineConfigError) as info:
        parse_pipeline(data, source="pipe.yaml", registry=_registry())
    msg = str(info.value)
    assert msg.startswith("pipe.yaml, stage 0 (thinker), key 'executor': unknown executor 'fake.thinker'")
    assert "known executors: aligner.pocketsphinx, aligner.vad, qwen3_omni.code2wav" in msg

    for st, ex in zip(data["stages"], EXECUTOR_NAMES):
        st["executor"] = ex
    data["stages"][1]["chunk_processor"] = "talker_to_codewav"
    msg = _error(data, registry=_registry())
    assert "stage 1 (talker), key 'chunk_processor': unknown processor 'talker_to_codewav'" in msg
    assert "did you mean 'talker_to_code2wav'" in msg


# ---------------------------------------------------------------------------------------
# loading files


def test_shipped_pipelines_are_listed() -> None:
    assert set(SHIPPED) <= set(shipped_pipeline_names())


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("override", [None, True, False])
def test_every_shipped_pipeline_validates(name: str, override: bool | None) -> None:
    cfg = load_pipeline(name, async_chunk_override=override, registry=_registry())
    assert cfg.name == name
    assert cfg.source.endswith(f"{name}.yaml")
    assert cfg.any_stage_chunks() is (override is not False)
    assert len(cfg.edges()) == cfg.num_stages - 1


def test_every_shipped_file_is_loadable_by_path() -> None:
    for name in shipped_pipeline_names():
        cfg = load_pipeline(name)
        assert load_pipeline(Path(cfg.source)) == cfg


def test_qwen3_omni_deploy_defaults() -> None:
    """docs/protocol.md §1.8."""
    cfg = load_pipeline("qwen3-omni")
    assert cfg.async_chunk is True and cfg.input_wait_timeout_s == 600
    thinker, talker, code2wav = cfg.stages
    assert [s.max_num_seqs for s in cfg.stages] == [64, 64, 64]
    assert thinker.devices != talker.devices and talker.devices == code2wav.devices
    assert (talker.sampling.seed, talker.sampling.temperature, talker.sampling.stop_token_ids) == (
        42,
        0.9,
        (2150,),
    )
    assert code2wav.execution_type is ExecutionType.GENERATION
    assert code2wav.max_num_batched_tokens == 65536 and code2wav.async_scheduling is False
    e01, e12 = cfg.edges()
    # One process per device by default: the Talker and Code2Wav share cuda:1 (an
    # in-process edge), the Thinker on cuda:0 is reached through shared memory.
    assert cfg.device_groups is DeviceGroups.AUTO
    assert e01.connector == e12.connector and (e01.backend, e12.backend) == ("shm", "inproc")
    # A process per stage when asked: both edges through shared memory.
    apart = cfg.with_device_groups("off")
    assert [e.backend for e in apart.edges()] == ["shm", "shm"]
    assert e12.extra == {"codec_chunk_frames": 25, "codec_left_context_frames": 0}
    assert (e01.contract, e12.contract) == (EdgeContract.CHUNKS, EdgeContract.CHUNKS)
    assert (e01.processor, e12.processor) == ("thinker_to_talker", "talker_to_code2wav")
    assert cfg.final_output_stage_ids(["text"]) == (0,)
    assert cfg.final_output_stage_ids(["text", "audio"]) == (0, 2)


def test_qwen3_omni_tiny_same_topology_small_settings() -> None:
    real, tiny = load_pipeline("qwen3-omni"), load_pipeline("qwen3-omni-tiny")
    assert [(s.id, s.execution_type, s.executor, s.input_sources) for s in real.stages] == [
        (s.id, s.execution_type, s.executor, s.input_sources) for s in tiny.stages
    ]
    assert [(e.label, e.contract, e.processor) for e in real.edges()] == [
        (e.label, e.contract, e.processor) for e in tiny.edges()
    ]
    for s in tiny.stages:
        assert s.executor_args == {"tiny": True, "seed": 0, "num_threads": 1}
        assert s.max_num_seqs <= real.stages[s.id].max_num_seqs


@pytest.mark.parametrize("name", ["qwen3-tts-tiny", "qwen3-tts", "qwen3-tts-0.6b"])
def test_tts_mixed_contracts(name: str) -> None:
    cfg = load_pipeline(name)
    assert [s.executor for s in cfg.stages] == [
        "qwen3_tts.talker",
        "qwen3_tts.code2wav",
        "aligner.pocketsphinx",
    ]
    assert [cfg.resolved_async_chunk(s) for s in cfg.stages] == [True, True, False]
    assert [e.contract for e in cfg.edges()] == [EdgeContract.CHUNKS, EdgeContract.COMPLETE_INPUT]
    assert cfg.edges()[1].input_builder == "code2wav_to_aligner"
    assert not cfg.stage_receives_chunks(2)
    assert cfg.final_output_stage_ids(["audio", "timestamps"]) == (1, 2)


def test_missing_file_lists_shipped_names(tmp_path: Path) -> None:
    for target in ("no-such-pipeline", str(tmp_path / "missing.yaml"), str(tmp_path)):
        with pytest.raises(ConfigError) as info:
            load_pipeline(target)
        assert type(info.value) is ConfigError  # not a file that fails validation: no file at all
        for name in SHIPPED:
            assert name in str(info.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(PipelineConfigError) as info:
        _load_text(tmp_path, "name: x\nstages:\n  - id: 0\n   name: a\n")
    assert f"{tmp_path / 'pipe.yaml'}:4:" in str(info.value)
    assert "invalid YAML" in str(info.value)


def test_duplicate_yaml_keys_are_errors(tmp_path: Path) -> None:
    with pytest.raises(
        PipelineConfigError, match=r"pipe.yaml:3:1: .*duplicate key 'async_chunk' \(first at line 2\)"
    ):
        _load_text(tmp_path, "name: x\nasync_chunk: true\nasync_chunk: false\nstages: []\n")


def test_yaml_anchors_and_merge_keys_work(tmp_path: Path) -> None:
    text = (
        "name: x\n"
        "stages:\n"
        "  - &common {id: 0, name: a, execution_type: ar, executor: e, final_output: true, final_output_type: text}\n"
        "  - <<: *common\n"
        "    id: 1\n"
        "    name: b\n"
        "    input_sources: [0]\n"
    )
    cfg = _load_text(tmp_path, text, async_chunk_override=False)
    assert [(s.id, s.name, s.executor) for s in cfg.stages] == [(0, "a", "e"), (1, "b", "e")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("just text\n", "the top level must be a mapping (key: value), got the string 'just text'"),
        ("name: x\nstages: {id: 0}\n", "key 'stages': expected a list of stages"),
        ("name: x\nstages: [3]\n", "stages[0] (unnamed): expected a mapping, got the int 3"),
        ("1: x\nname: y\nstages: []\n", "key '1': keys must be strings"),
    ],
)
def test_malformed_documents(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(PipelineConfigError) as info:
        _load_text(tmp_path, text)
    assert str(tmp_path / "pipe.yaml") in str(info.value)
    assert expected in str(info.value)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_pipeline(path)


def test_config_crosses_processes_as_msgpack() -> None:
    cfg = load_pipeline("qwen3-tts-tiny")
    wire = msgspec.msgpack.encode(cfg)
    back = msgspec.msgpack.decode(wire, type=PipelineConfig)
    assert back == cfg
    assert back.stages[2].connector_role is None and back.stages[0].sampling.stop_token_ids == (2150,)
    assert ConnectorRole("sender") is ConnectorRole.SENDER


def test_public_exports() -> None:
    for name in pipeline_pkg.__all__:
        assert hasattr(pipeline_pkg, name), name
    assert sorted(pipeline_pkg.__all__) == sorted(set(pipeline_pkg.__all__))


# ---------------------------------------------------------------------------------------
# openai_voices: OpenAI voice names mapped to the pipeline's own


def test_openai_voices_load_and_their_shape_is_checked() -> None:
    cfg = parse_pipeline(_omni(openai_voices={"alloy": "chelsie", "Echo": "ethan"}))
    assert cfg.openai_voices == {"alloy": "chelsie", "Echo": "ethan"}
    assert parse_pipeline(_omni()).openai_voices == {}
    for shipped in ("voice-cpu", "qwen3-omni", "qwen3-omni-tiny", "qwen3-tts", "qwen3-tts-tiny"):
        assert "alloy" in load_pipeline(shipped).openai_voices
    cases = [
        (["alloy"], "key 'openai_voices': expected a mapping of voice names, got a list"),
        ({"alloy": 3}, "key 'openai_voices': names and voices must be strings, got the int 3"),
        ({"alloy": ""}, "key 'openai_voices.alloy': '' is not a voice name"),
        ({"al loy": "chelsie"}, "key 'openai_voices.al loy': 'al loy' is not a voice name"),
        ({"alloy": "chelsie", "ALLOY": "ethan"}, "'ALLOY' is mapped twice (also as 'alloy')"),
    ]
    for value, expected in cases:
        message = _error(_omni(openai_voices=value))
        assert "pipe.yaml" in message and expected in message, message
