"""A Triton kernels module imported for the Triton interpreter, on the CPU.

``triton`` decides at import whether its own library functions (``tl.sum``…) are
interpreted, and another test may have imported it already (``torch`` does, for
``inductor``): then its modules are set aside, imported afresh for the interpreter, and
put back afterwards (at exit ``nanobind`` may then list the set-aside copies as leaked:
harmless). With a GPU the kernels' tests run them compiled instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="needs triton (not a dependency: the GPU install has it)"
)


def _triton_modules() -> dict[str, Any]:
    """``triton``'s Python modules loaded now (its compiled extension stays loaded)."""
    return {
        name: module
        for name, module in sys.modules.items()
        if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
    }


def interpreted_import(kernels: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The module ``kernels`` built for the Triton interpreter (a fixture's body)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests run these kernels compiled")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    saved = _triton_modules()
    saved_kernels = sys.modules.pop(kernels, None)
    for name in saved:
        del sys.modules[name]
    try:
        yield importlib.import_module(kernels)
    finally:
        sys.modules.pop(kernels, None)
        if saved:
            for name in _triton_modules():
                del sys.modules[name]
            sys.modules.update(saved)
        if saved_kernels is not None:
            sys.modules[kernels] = saved_kernels
