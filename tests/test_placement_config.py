"""``placement:`` and per-stage ``resources:``: parsing, clear errors, edge backends resolved
from where stages run, and what ``omnirelay check`` prints."""

from __future__ import annotations

import io
from typing import Any

import pytest

from omnirelay.cli.check import build_report, render_report
from omnirelay.errors import ConfigError
from omnirelay.pipeline import load_pipeline, parse_pipeline
from omnirelay.pipeline.yamlfile import parse_yaml, read_pipeline_text


def _two_host(**changes: Any) -> dict[str, Any]:
    source, text = read_pipeline_text("qwen3-omni-tiny-2host")
    data = parse_yaml(text, source)
    for key, value in changes.items():
        if key.startswith("stage"):
            data["stages"][int(key[5:])].update(value)
        else:
            data[key] = value
    return data


def test_the_shipped_two_host_pipeline_resolves_its_edges_from_placement() -> None:
    cfg = load_pipeline("qwen3-omni-tiny-2host")
    assert cfg.placement.is_ray and cfg.placement.address == "auto"
    assert {e.label: e.backend for e in cfg.edges()} == {"0 -> 1": "shm", "1 -> 2": "nixl"}
    out = io.StringIO()
    report = build_report(cfg)
    render_report(report, out)
    assert "codec_shm (nixl:" in out.getvalue() and "placed on a Ray node offering hostB: 1" in out.getvalue()
    assert report["placement"]["backend"] == "ray" and report["stages"][2]["resources"] == {"hostB": 1.0}


def test_an_edge_override_wins_and_unpinned_stages_cross_hosts() -> None:
    cfg = parse_pipeline(_two_host(placement={"backend": "ray", "edges": {"0->1": "nixl"}}))
    assert {e.label: e.backend for e in cfg.edges()} == {"0 -> 1": "nixl", "1 -> 2": "nixl"}
    cfg = parse_pipeline(_two_host(stage1={"resources": {}}))  # the talker may land anywhere
    assert {e.label: e.backend for e in cfg.edges()} == {"0 -> 1": "nixl", "1 -> 2": "nixl"}
    local = load_pipeline("qwen3-omni-tiny")
    assert {e.backend for e in local.edges()} == {"shm"}


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"placement": {"backend": "slurm"}}, "unknown placement backend 'slurm'"),
        ({"placement": {"backend": "ray", "adress": "x"}}, "key 'adress'"),
        ({"placement": {"backend": "ray", "address": ""}}, "Ray cluster's address"),
        ({"placement": {"backend": "ray", "edges": {"1 to 2": "nixl"}}}, "'src -> dst'"),
        ({"placement": {"backend": "ray", "edges": {"0 -> 2": "nixl"}}}, "no such edge"),
        ({"placement": {"backend": "ray", "edges": {"1 -> 2": "rdma"}}}, "unknown backend 'rdma'"),
        ({"placement": {"backend": "ray", "edges": {"1 -> 2": "shm"}}}, "shm cannot cross hosts"),
        ({"placement": {"backend": "local"}}, "resources place a stage on a Ray node"),
        ({"stage2": {"resources": {"hostB": 0}}}, "amount > 0"),
        ({"stage2": {"resources": ["hostB"]}}, "expected a mapping"),
        ({"placement": "ray"}, "expected a mapping"),
    ],
)
def test_bad_placement_is_refused_with_the_place_and_a_fix(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_pipeline(_two_host(**changes), source="two.yaml")
    assert words in str(err.value) and "two.yaml" in str(err.value)


def test_a_nixl_edge_takes_its_timing_options_from_the_connector_extra() -> None:
    import msgspec

    from omnirelay.engine.edge_connectors import _options

    config = load_pipeline("qwen3-omni-tiny-2host")
    codec = config.connector_spec("codec_shm")
    extra = {**codec.extra, "nixl_lease_s": 3.0, "nixl_read_timeout_s": 4.0}
    config = msgspec.structs.replace(
        config, connectors={**config.connectors, "codec_shm": msgspec.structs.replace(codec, extra=extra)}
    )
    talker, code2wav = config.stages[1], config.stages[2]
    for stage, listens in ((talker, False), (code2wav, True)):
        options = _options(config, stage, "nixl", listens=listens)
        assert options["lease_s"] == 3.0 and options["read_timeout_s"] == 4.0
        assert "codec_chunk_frames" not in options and options["listen"] is listens
    assert "lease_s" not in _options(config, talker, "shm", listens=False)  # nixl's alone
