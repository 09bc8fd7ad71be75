"""The README's examples run as written: every code block is run by a test.

* The set-up block: ``.ci/run`` reads its install line and its test command from the
  README and runs them on a fresh clone (nothing else), and its ``omnirelay run`` runs here.
* The Python API block is taken out of README.md and run in a fresh interpreter from the
  repository root, as a user would paste it into a file; it must finish, print what it
  says and leave nothing behind.
* Every other block runs in the README's order in one folder: the shell blocks with
  bash, exactly as printed (the servers they start in the background are the ones the
  Python blocks talk to), then the Python blocks together in one interpreter, as a user
  pastes them one after the other. The servers are stopped with SIGTERM at the end and
  must leave nothing in ``/dev/shm``.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _shm_objects(pid: int) -> list[str]:
    """The /dev/shm objects of pipelines started by process ``pid`` (a pipeline's default
    namespace is ``p<pid>x…``; other processes' objects are not this example's)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"omnirelay-p{pid}x")]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_python_api_example_runs_as_written(tmp_path: Path) -> None:
    blocks = [b for b in _python_blocks() if "from omnirelay import" in b]
    assert len(blocks) == 1, "README.md must hold exactly one Python API example"
    imported = [
        node for node in ast.walk(ast.parse(blocks[0])) if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    modules = {n.module for n in imported if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in imported if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in modules if m and m.startswith("omnirelay")} == {"omnirelay"}, (
        "the example uses omnirelay's top-level names only"
    )
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-4000:]
    found = re.search(r"\n(\d+) audio samples\n", stdout)
    assert found is not None and int(found.group(1)) > 0, stdout[-2000:]
    assert _shm_objects(proc.pid) == [], "the example left omnirelay objects in /dev/shm"


def test_the_readme_opens_with_the_two_setup_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert first_block is not None
    lines = [ln for ln in first_block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 2
    assert "pip install" in lines[0] and "omnirelay run" in lines[0]
    install = lines[0].split("&& omnirelay run", 1)[0].strip()
    test_command = lines[1].split("#")[0].strip()
    assert _ci_commands() == [install, test_command], "CI must run the README's two commands"


def _ci_commands() -> list[str]:
    """What ``.ci/run`` installs and tests with, as it prints them (``--print``)."""
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout.splitlines()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_the_setup_block_is_what_ci_runs() -> None:
    """CI installs exactly the README's install line (it has no pip line of its own), and
    that line installs the optional parts the suite tests (NIXL; Ray through ``dev``; the
    voice-agent frameworks the realtime client tests drive, through ``agents``)."""
    install = _bash_blocks()[0].splitlines()[0].split("&& omnirelay run", 1)[0]
    for step in install.split("&&"):
        assert step.split()[:2] == ["pip", "install"], step
    assert "'nixl-cu12>=1.5,<2'" in install and "'.[dev,agents]'" in install
    ci = (ROOT / ".ci" / "run").read_text()
    own = [ln for ln in ci.splitlines() if re.search(r"(^\s*|[;&|]\s*|-m\s+)pip\s", ln)]
    assert own == [], f".ci/run installs something the README does not: {own}"


def test_every_other_block_runs_as_written(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bash = _bash_blocks()
    setup_run = "omnirelay run" + bash[0].splitlines()[0].split("&& omnirelay run", 1)[1].split("#")[0]
    Image.fromarray(np.full((64, 96, 3), (40, 120, 200), np.uint8)).save(tmp_path / "photo.png")
    servers: list[int] = []
    try:
        for block in [setup_run, *bash[1:]]:
            # A block that starts a server in the background: its pid, for the stop at the end.
            script = block + ("\necho omnirelay-server-pid=$!\n" if "&\n" in block else "")
            # Files, not pipes: a server the block leaves running keeps its output open.
            out, err = tmp_path / "block.out", tmp_path / "block.err"
            with out.open("w") as stdout, err.open("w") as stderr:
                done = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", script],
                    cwd=tmp_path,
                    env=env,
                    stdout=stdout,
                    stderr=stderr,
                    timeout=240,
                )
            printed = out.read_text()
            servers += [int(m) for m in re.findall(r"omnirelay-server-pid=(\d+)", printed)]
            assert done.returncode == 0, f"{block}\n{printed[-2000:]}\n{err.read_text()[-3000:]}"
            if "curl -s http://127.0.0.1:8000/v1/chat/completions" in block:
                assert '"object":"chat.completion"' in printed, printed[-2000:]
        assert (tmp_path / "answer.wav").stat().st_size > 44 and (tmp_path / "moon.json").is_file()
        assert len(servers) == 2
        python = [b for b in _python_blocks() if "from omnirelay import" not in b]
        (tmp_path / "blocks.py").write_text("\n".join(python))
        ran = subprocess.run(
            [sys.executable, "blocks.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        assert "Paris" in ran.stdout and "what is the capital of france" in ran.stdout, ran.stdout
        assert (tmp_path / "speech.mp3").stat().st_size > 1000
    finally:
        for pid in servers:
            os.kill(pid, signal.SIGTERM)
        stopped = [_gone(pid, 60) for pid in servers]
    assert all(stopped), "a README server did not stop on SIGTERM"
    for pid in servers:
        assert _shm_objects(pid) == [], "a README server left omnirelay objects in /dev/shm"


def test_what_the_quick_start_writes_is_ignored_by_git() -> None:
    written = set(re.findall(r"--(?:out|json) (\S+)", README)) | set(
        re.findall(r'open\("([^"]+)", "wb"\)', README)
    )
    assert {"answer.wav", "moon.wav", "moon.json", "speech.mp3"} <= written
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", *sorted(written)], cwd=ROOT, capture_output=True, text=True)
    assert sorted(done.stdout.split()) == sorted(written), "git would offer these to commit"
