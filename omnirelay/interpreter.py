"""Which Python runs omnirelay, and whether it is a build known to be slow.

The hot paths of a stage process (the transfer adapter, the shm connector's bookkeeping,
the codec) are interpreted Python, so the interpreter's build shows in every latency
figure: a build without profile-guided and link-time optimization that loads libpython
as a shared library runs the same code measurably slower (docs/performance.md, "The
Python build"). ``omnirelay doctor`` reports the build and warns about that combination; every benchmark
records it beside its figures.

Only facts that can be read are reported: the configure flags CPython records, and
whether libpython is mapped from a shared library (Linux). A distribution may optimize
without recording ``--enable-optimizations`` (Debian does), which is why the warning needs
both signs.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import sysconfig
from typing import Any, NamedTuple

__all__ = ["InterpreterInfo", "interpreter_info", "read_interpreter_info"]


class InterpreterInfo(NamedTuple):
    executable: str
    implementation: str
    version: str
    #: ``--enable-optimizations`` (PGO) among the recorded configure flags.
    configured_optimized: bool
    #: libpython is mapped from a shared library (None: not known on this platform).
    shared_libpython: bool | None

    @property
    def is_likely_slow(self) -> bool:
        """A CPython whose configure flags name no PGO and whose libpython is shared: the
        build pyenv makes by default with ``--enable-shared``."""
        return (
            self.implementation == "CPython"
            and not self.configured_optimized
            and self.shared_libpython is True
        )

    def describe(self) -> str:
        libpython = {True: "shared library", False: "linked in", None: "unknown"}[self.shared_libpython]
        flags = "--enable-optimizations" if self.configured_optimized else "no --enable-optimizations"
        return (
            f"{self.implementation} {self.version} at {self.executable} "
            f"(libpython: {libpython}; configure: {flags})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "is_likely_slow": self.is_likely_slow}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InterpreterInfo:
        """Back from :meth:`to_dict` (a benchmark's JSON)."""
        return cls(*(d[name] for name in cls._fields))


_PGO_FLAG = re.compile(r"(?<![\w-])--enable-optimizations(?![\w-])")

#: What ``omnirelay doctor`` prints under a slow build.
SLOW_BUILD_ADVICE = (
    "this looks like an unoptimized CPython build (no profile-guided optimization, libpython "
    "as a shared library: pyenv's build with --enable-shared). A stage's hot paths are "
    "interpreted Python: a codec chunk's transfer took a sixth to a third longer under such a "
    "build than under Debian's python3.11 on the same machine. For serving and benchmarks use an optimized "
    "interpreter: a distribution's python3, a python.org or uv-managed build, or pyenv with "
    "PYTHON_CONFIGURE_OPTS='--enable-optimizations --with-lto'."
)


def read_interpreter_info(config_args: str, maps: str | None) -> InterpreterInfo:
    """The facts, from CPython's recorded configure flags and ``/proc/self/maps`` (None:
    not readable); split out so that tests can give both."""
    shared: bool | None = None
    if maps is not None:
        shared = any(
            os.path.basename(line.rsplit(None, 1)[-1]).startswith("libpython")
            for line in maps.splitlines()
            if "/" in line
        )
    return InterpreterInfo(
        executable=sys.executable,
        implementation=platform.python_implementation(),
        version=platform.python_version(),
        configured_optimized=_PGO_FLAG.search(config_args) is not None,
        shared_libpython=shared,
    )


def interpreter_info() -> InterpreterInfo:
    """The running interpreter's build."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps: str | None = f.read()
    except OSError:
        maps = None
    return read_interpreter_info(str(sysconfig.get_config_var("CONFIG_ARGS") or ""), maps)
