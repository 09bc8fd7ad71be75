"""Setting up and starting, where it used to go wrong late or not at all:

* a pipeline across hosts (``--local-cluster``, ``placement: {backend: ray}``, an edge over
  ``nixl``) on a machine without Ray or NIXL fails at once, in one line that names what to
  install — before a Ray cluster or a stage starts; ``doctor`` says the same;
* omnirelay imports, and finds its shipped pipelines, from the folder a checkout named
  ``omnirelay`` lies in (where that checkout is also a folder named ``omnirelay``).

Missing packages are simulated with stub packages first on ``PYTHONPATH`` whose import
raises ``ImportError``; every command runs in its own interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY_HINT = "pip install -e '.[multihost]'"
NIXL_HINT = "pip install --no-deps 'nixl-cu12>=1.5,<2'"
#: Well under what starting a Ray cluster and its stages takes (a minute and more here).
QUICK_S = 45.0


def _hide(tmp_path: Path, *modules: str) -> Path:
    """A folder of packages named ``modules`` whose import raises ImportError."""
    stubs = tmp_path / "stubs"
    for name in modules:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('No module named {name} (hidden)')\n")
    return stubs


def _omnirelay(stubs: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(ROOT)])}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "omnirelay.cli.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return done, time.monotonic() - start


def _fails_at_once_in_one_line(done: subprocess.CompletedProcess[str], elapsed_s: float) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert elapsed_s < QUICK_S, f"took {elapsed_s:.0f} s: something started before the check"
    return lines[0]


def test_local_cluster_without_ray_and_nixl_names_both_installs(tmp_path: Path) -> None:
    stubs = _hide(tmp_path, "ray", "nixl_cu12", "nixl")
    done, elapsed = _omnirelay(
        stubs, "run", "--pipeline", "qwen3-omni-tiny-2host", "--local-cluster", "--prompt", "Hi"
    )
    line = _fails_at_once_in_one_line(done, elapsed)
    assert line.startswith("omnirelay run: error: pipeline 'qwen3-omni-tiny-2host' needs Ray"), line
    assert "NIXL (edge 1 -> 2 over nixl)" in line
    assert line.endswith(f"{RAY_HINT} && {NIXL_HINT}"), line
    assert "starting" not in done.stderr  # no cluster, no stage


def test_local_cluster_without_nixl_names_only_nixl(tmp_path: Path) -> None:
    stubs = _hide(tmp_path, "nixl_cu12", "nixl")
    done, elapsed = _omnirelay(
        stubs, "run", "--pipeline", "qwen3-omni-tiny-2host", "--local-cluster", "--prompt", "Hi"
    )
    line = _fails_at_once_in_one_line(done, elapsed)
    assert "needs NIXL (edge 1 -> 2 over nixl), which is not installed" in line and "Ray" not in line
    assert line.endswith(f": {NIXL_HINT}"), line


def test_serve_of_a_ray_pipeline_without_ray_names_the_multihost_extra(tmp_path: Path) -> None:
    # With NIXL absent too, the line names both installs (the test above covers that).
    pytest.importorskip("nixl_cu12", reason=f"NIXL is not installed: {NIXL_HINT}")
    stubs = _hide(tmp_path, "ray")
    done, elapsed = _omnirelay(stubs, "serve", "--pipeline", "qwen3-omni-tiny-2host", "--port", "0")
    line = _fails_at_once_in_one_line(done, elapsed)
    assert line.startswith("omnirelay serve: error: ") and "Ray (placement backend ray)" in line, line
    assert line.endswith(f": {RAY_HINT}") and "NIXL" not in line, line


def test_doctor_reports_ray_beside_nixl(tmp_path: Path) -> None:
    report = tmp_path / "doctor.json"
    done, _ = _omnirelay(_hide(tmp_path, "ray"), "doctor", "--json", str(report))
    assert f"ray placement: not installed (Ray is not installed: {RAY_HINT})" in done.stdout
    assert "nixl connector:" in done.stdout
    assert json.loads(report.read_text())["ray_version"] is None
    installed, _ = _omnirelay(tmp_path / "none", "doctor")
    ray_version = pytest.importorskip("ray").__version__
    assert f"ray placement: ready (Ray {ray_version})" in installed.stdout


# --------------------------------------------------------------------------- the parent folder


def _editable_from_this_checkout() -> str | None:
    """Why the installed omnirelay cannot show the parent-folder layout (None: it can)."""
    installs = []
    for dist in metadata.distributions(name="omnirelay"):
        direct = json.loads(dist.read_text("direct_url.json") or "{}")  # pip's record of the install
        if direct:
            installs.append(direct)
    if not installs:
        return "omnirelay is not installed with pip (pip install -e .)"
    for direct in installs:
        url = str(direct.get("url", ""))
        here = url.startswith("file://") and Path(url.removeprefix("file://")).resolve() == ROOT
        if here and direct.get("dir_info", {}).get("editable"):
            return None
    return f"omnirelay is not installed editable from this checkout ({installs[0].get('url')}), so it is not imported from here"


def test_omnirelay_imports_and_finds_its_pipelines_from_the_checkouts_parent_folder(tmp_path: Path) -> None:
    why = _editable_from_this_checkout()
    if why is not None:
        pytest.skip(why)
    (tmp_path / "omnirelay").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "from omnirelay import Pipeline; from omnirelay.pipeline import load_pipeline; "
        "print(load_pipeline('voice-cpu').name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "voice-cpu"
