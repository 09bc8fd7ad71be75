"""Which Python build runs omnirelay: the facts read, the slow-build warning, and where
they are reported (``omnirelay doctor``, every benchmark's environment)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from omnirelay.cli.main import main
from omnirelay.interpreter import InterpreterInfo, interpreter_info, read_interpreter_info

_SHARED_MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 1234   /root/.pyenv/versions/3.11.7/bin/python3.11
7f8e40000000-7f8e40200000 r-xp 00000000 08:01 5678   /root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0
7f8e40f4e000-7f8e40f4f000 rw-p 00000000 00:00 0
7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0      [stack]
"""
_STATIC_MAPS = """\
55d0c0a00000-55d0c0f01000 r-xp 00000000 08:01 1234   /usr/bin/python3.11
7f8e40000000-7f8e40200000 r-xp 00000000 08:01 5678   /usr/lib/x86_64-linux-gnu/libc.so.6
"""


def test_the_configure_flags_and_the_mapped_libpython_are_read() -> None:
    pyenv = read_interpreter_info("'--prefix=/root/.pyenv/versions/3.11.7' '--enable-shared'", _SHARED_MAPS)
    assert pyenv.shared_libpython is True and pyenv.configured_optimized is False
    assert pyenv.is_likely_slow == (platform.python_implementation() == "CPython")
    assert "libpython: shared library; configure: no --enable-optimizations" in pyenv.describe()

    optimized = read_interpreter_info("'--enable-optimizations' '--with-lto' '--enable-shared'", _SHARED_MAPS)
    assert optimized.configured_optimized and not optimized.is_likely_slow  # docker's python

    static = read_interpreter_info("'--prefix=/usr' '--with-system-expat'", _STATIC_MAPS)
    assert static.shared_libpython is False and not static.is_likely_slow  # Debian optimizes unrecorded
    assert "libpython: linked in" in static.describe()

    unknown = read_interpreter_info("", None)  # no /proc: nothing is claimed
    assert unknown.shared_libpython is None and not unknown.is_likely_slow
    assert "libpython: unknown" in unknown.describe()

    # A flag is a whole word, not a prefix of another one.
    assert not read_interpreter_info("'--enable-optimizations-x'", None).configured_optimized


def test_the_facts_travel_as_json_and_back() -> None:
    info = interpreter_info()
    d = json.loads(json.dumps(info.to_dict()))
    assert d["is_likely_slow"] == info.is_likely_slow
    assert InterpreterInfo.from_dict(d) == info
    assert info.version == platform.python_version()


def _slow_build() -> InterpreterInfo:
    return InterpreterInfo("/opt/py/bin/python", "CPython", "3.11.7", False, True)


def test_doctor_names_the_build_and_warns_about_a_slow_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from omnirelay.cli import doctor

    report = tmp_path / "doctor.json"
    monkeypatch.setattr(doctor, "interpreter_info", _slow_build)
    assert main(["doctor", "--namespace", "nothing.here", "--json", str(report)]) == 0  # a warning only
    out = capsys.readouterr().out
    assert "python: CPython 3.11.7 at /opt/py/bin/python (libpython: shared library" in out
    assert "warning: this looks like an unoptimized CPython build" in out
    assert "--enable-optimizations --with-lto" in out  # what to do about it
    assert json.loads(report.read_text())["python"]["is_likely_slow"] is True

    monkeypatch.setattr(doctor, "interpreter_info", lambda: _slow_build()._replace(shared_libpython=False))
    assert main(["doctor", "--namespace", "nothing.here"]) == 0
    out = capsys.readouterr().out
    assert "python: CPython 3.11.7" in out and "warning" not in out
