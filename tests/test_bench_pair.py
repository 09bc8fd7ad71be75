"""``benchmarks.pair_adapter_runs``: one reduced pair under this interpreter on both sides
(the comparison itself is judged by hand, never here), the summary's arithmetic, and the
refusals of bad arguments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import pair_adapter_runs as pair
from tests.test_bench_adapter import _run_result

REPO = Path(__file__).resolve().parent.parent


def test_the_summary_pairs_runs_and_leaves_failed_pairs_out() -> None:
    pairs = [
        (_run_result(170.0, 80.0, 4000.0), _run_result(130.0, 80.0, 4000.0)),
        (_run_result(160.0, 80.0, 4000.0), _run_result(165.0, 80.0, 4000.0)),
        (_run_result(180.0, 80.0, 4000.0), {"error": "exit 1"}),
        (_run_result(150.0, 80.0, 4000.0), _run_result(120.0, 80.0, 4000.0)),
    ]
    s = pair.summarize(pairs)
    assert (s["num_pairs"], s["num_complete"]) == (4, 3)
    assert s["a"]["adapter_p50_us"] == 160.0 and s["b"]["adapter_p50_us"] == 130.0
    assert s["adapter_diff_us"]["median"] == -30.0 and s["b_faster_in"] == 2
    assert s["a"]["all_ok"] and s["b"]["all_ok"]
    assert pair.summarize([(_run_result(1.0, 1.0, 1.0), {"error": "x"})]) == {
        "num_pairs": 1,
        "num_complete": 0,
    }


def test_a_reduced_pair_runs_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pair.json"
    repo = str(REPO)
    assert pair.main(["--pairs", "1", "--chunks", "20", "--b-path", repo, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pair 1 of 1" in text and "B faster in" in text and "LEAK" not in text
    report = json.loads(out.read_text())
    ((a, b),) = report["pairs"]
    assert a["ok"] and b["ok"]
    # Twenty chunks per kind on a loaded machine say nothing about which path is faster
    # (the order of the medians flips): only that each side measured all three kinds.
    for side in (a, b):
        for kind in ("adapter_published", "raw_connector", "floor_wake"):
            assert side["latency"][kind]["p50_us"] > 0, (kind, side["latency"][kind])
    assert report["sides"][0]["python"] and report["sides"][1]["path"] == repo


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--pairs", "0"], "--pairs must be >= 1"),
        (["--chunks", "0"], "--chunks must be >= 1"),
        (["--a", "no-such-python-here"], "no interpreter 'no-such-python-here'"),
        (["--b-path", "/"], "holds no omnirelay package"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        pair.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_side_with_a_path_runs_that_checkout_from_any_directory(tmp_path: Path) -> None:
    # A stand-in checkout whose bench command only says it ran. This test runs from the
    # repository's root, whose own omnirelay must not shadow it.
    main = tmp_path / "checkout" / "omnirelay" / "cli" / "main.py"
    main.parent.mkdir(parents=True)
    for pkg in (main.parent.parent, main.parent):
        (pkg / "__init__.py").write_text("")
    main.write_text(
        "import json, sys\n"
        "argv = sys.argv[1:]\n"
        "with open(argv[argv.index('--json') + 1], 'w') as f:\n"
        "    json.dump({'error': 'the stand-in checkout ran'}, f)\n"
    )
    report = pair.run_once(sys.executable, str(main.parents[2]), 20, str(tmp_path / "out.json"), 60.0)
    assert report == {"error": "the stand-in checkout ran"}
