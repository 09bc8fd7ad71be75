"""``omnirelay bench serve``: a smoke run with tiny numbers against a self-started server
(the bench starts and stops the pipeline itself, then audits), a run against a server
given by ``--url``, the loopback-only rule and argument bounds. No timing asserts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from benchmarks.serve import check_loopback_url, render_serve_bench, run_serve_bench
from omnirelay.cli.main import main
from omnirelay.serving import ServerConfig
from tests.orchestrator_audit import child_pids
from tests.serving_support import Served, serve

MODEL = "qwen3-omni-tiny"
TEXT = "Hello there."


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, ServerConfig())


def _check_levels(report: dict, levels: list[int], requests: int) -> None:
    assert [lv["concurrency"] for lv in report["levels"]] == levels
    for lv in report["levels"]:
        assert lv["requests"] == requests and lv["ok"] == requests and lv["errors"] == {}
        assert lv["ttfa_s"]["p50"] <= lv["ttfa_s"]["p99"] <= lv["latency_s"]["p99"]
        assert lv["audio_s"] > 0 and lv["rtf_aggregate"] > 0 and lv["requests_per_s"] > 0
        assert lv["processing_per_audio"]["p50"] > 0


def test_against_a_running_server(served: Served) -> None:
    report = run_serve_bench(url=served.url, concurrency=[1, 2], requests=2, warmup=0, text=TEXT)
    assert report["ok"] and not report["self_started"] and report["model"] == MODEL
    _check_levels(report, [1, 2], 2)
    table = render_serve_bench(report)
    assert "TTFA p50 ms" in table and "RTF agg" in table and "req/s" in table
    served.audit()  # the bench left nothing behind in the server or the pipeline


def test_self_started_cli(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    before = set(child_pids())
    out = tmp_path / "serve.json"
    args = ["--concurrency", "1,2", "--requests", "2", "--warmup", "0", "--text", TEXT]
    rc = main(["bench", "serve", *args, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "leak audit: clean" in printed and "TTFA p50 ms" in printed
    report = json.loads(out.read_text())
    assert report["self_started"] and report["pipeline"] == MODEL and report["audit"]["clean"]
    _check_levels(report, [1, 2], 2)
    assert set(child_pids()) <= before  # every stage worker it started is gone


def test_self_started_on_the_default_voice(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default pipeline (voice-cpu: SmolLM2 reads the text, Piper speaks it), reduced to
    one request: it is served, and the bench's leak audit is clean."""
    out = tmp_path / "voice.json"
    args = ["--pipeline", "voice-cpu", "--concurrency", "1", "--requests", "1", "--warmup", "0"]
    rc = main(["bench", "serve", *args, "--text", TEXT, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "leak audit: clean" in printed
    report = json.loads(out.read_text())
    assert report["pipeline"] == "voice-cpu" and report["ok"] and report["audit"]["clean"]
    _check_levels(report, [1], 1)


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"]
)
def test_only_loopback_urls(url: str) -> None:
    with pytest.raises(ValueError):
        check_loopback_url(url)


def test_loopback_urls_accepted() -> None:
    assert check_loopback_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_loopback_url("http://localhost:1") == "http://localhost:1"
    assert check_loopback_url("http://[::1]:9") == "http://[::1]:9"


@pytest.mark.parametrize(
    "kwargs",
    [{"concurrency": []}, {"concurrency": [0]}, {"concurrency": [1000]}, {"requests": 0}, {"timeout_s": 0}],
)
def test_bounds(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        run_serve_bench(url="http://127.0.0.1:1", **kwargs)


def test_cli_rejects_a_remote_url() -> None:
    with pytest.raises(SystemExit, match="loopback"):
        main(["bench", "serve", "--url", "http://192.0.2.1:8000"])
