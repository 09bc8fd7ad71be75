"""`omnirelay doctor` and a smoke run of `omnirelay bench transfer` (no timing asserts)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from omnirelay.cli.main import main
from omnirelay.connectors import create_connector
from tests.conftest import shm_entries

CTX = mp.get_context("spawn")


def _publish_and_hang(namespace: str, n: int, published: Any) -> None:
    conn = create_connector("shm", namespace=namespace, stage_id=1, sweep_on_start=False)
    for i in range(n):
        assert conn.put(1, 2, f"D_1_{i}", {"i": i}).ok
    published.set()
    signal.pause()


def test_doctor_lists_and_reclaims_dead_owners(
    namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live = create_connector("shm", namespace=namespace, stage_id=1)
    assert live.put(1, 2, "ALIVE_1_0", {"x": 1}).ok
    published = CTX.Event()
    p = CTX.Process(target=_publish_and_hang, args=(namespace, 4, published))
    p.start()
    assert published.wait(60)
    os.kill(p.pid or 0, signal.SIGKILL)
    p.join(60)

    assert main(["doctor", "--namespace", namespace]) == 0
    out = capsys.readouterr().out
    assert f"namespace {namespace}:" in out and "DEAD" in out and "'D_1_3'" in out and "'ALIVE_1_0'" in out
    assert "omnirelay doctor --reclaim" in out

    report = tmp_path / "doctor.json"
    assert main(["doctor", "--namespace", namespace, "--reclaim", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "reclaimed" in out
    data = json.loads(report.read_text())
    assert data["num_reclaimed"] >= 4  # 4 objects + the dead producer's slot files
    reclaimed_keys = {o["key"] for o in data["objects"] if o["reclaimed"] and o["kind"] == "object"}
    assert reclaimed_keys == {f"D_1_{i}" for i in range(4)}
    left = shm_entries(namespace)
    assert left and all(str(os.getpid()) in n or "-k-" in n for n in left)  # only the live owner's
    live.close()


def test_doctor_with_nothing_to_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--namespace", "nothing.here"]) == 0
    out = capsys.readouterr().out
    assert "no omnirelay objects" in out
    assert "shm connector: ready" in out  # the atomics the claims need are there


def test_doctor_says_when_the_shm_connector_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from omnirelay.connectors import create_connector
    from omnirelay.connectors.shm import atomics
    from omnirelay.errors import ConnectorError

    monkeypatch.setattr(atomics, "DEFAULT", None)  # neither the C extension nor libatomic
    monkeypatch.setattr(atomics, "_LIBATOMIC_PROBLEM", "libatomic is not available (test)")
    assert main(["doctor", "--namespace", "nothing.here"]) == 1
    assert "shm connector: UNAVAILABLE: libatomic is not available (test)" in capsys.readouterr().out
    with pytest.raises(ConnectorError, match="libatomic is not available"):
        create_connector("shm", namespace="nothing.here", sweep_on_start=False)


def test_bench_transfer_smoke(tmp_path: Path) -> None:
    from benchmarks.transfer import render_table, run_transfer_bench

    res = run_transfer_bench(["codec_chunk"], scale=0.02, log=lambda m: None)
    entry = res["payloads"]["codec_chunk"]
    assert entry["ours"]["n_latency"] > 0 and entry["baseline"]["n_latency"] > 0
    assert entry["limit_two_memcpy_us"] > 0 and entry["floor_wakeup_two_memcpy_us"] > 0
    assert res["leaks"] == []
    table = render_table(res)
    assert "codec_chunk" in table and "leak audit: 0" in table


def test_bench_transfer_across_hosts_smoke() -> None:
    """``bench transfer --backend nixl``, reduced: every transport moves the codec chunk,
    the table has its ratios, and nothing of the run is left in /dev/shm."""
    pytest.importorskip(
        "nixl_cu12", reason="NIXL is not installed: pip install --no-deps 'nixl-cu12>=1.5,<2'"
    )
    from benchmarks.transfer_hosts import render_hosts_table, run_hosts_bench

    res = run_hosts_bench(["codec_chunk"], scale=0.01, pin=False)
    entry = res["payloads"]["codec_chunk"]
    for kind in ("nixl", "shm", "zmq_tcp"):
        assert entry[kind]["n_latency"] > 0 and entry[kind]["p50_us"] > 0, kind
    assert res["leaks"] == []
    table = render_hosts_table(res)
    assert "codec_chunk" in table and "nixl/TCP" in table and "leak audit: 0" in table


def test_cli_help_explains(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["doctor", "--help"], ["bench", "transfer", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "doctor" in out and "--reclaim" in out and "memcpy" in out
