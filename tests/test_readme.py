"""The README's examples run as written.

The Python API block is taken out of README.md and run in a fresh interpreter from the
repository root, as a user would paste it into a file; it must finish, print what it
says and leave nothing behind. The set-up lines and the command table must name what
exists.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = lines[1].split("#")[0].strip()
    assert test_command in ci, "the README's test command and the one .ci/run runs must be the same"
