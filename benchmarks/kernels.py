"""A step's kernels by family: where a profiled step's launches and device time go.

:func:`family` sorts one kernel name (a CUDA kernel, or on the CPU an ``aten`` operator,
the launches' counterpart there) into one of :data:`FAMILIES`, by the names the
libraries give their kernels: cuBLAS's and CUTLASS's GEMMs (``nvjet``, ``gemm``,
``xmma``, ``cutlass``), attention (flash and memory-efficient kernels, softmax), norms,
sampling (top-k, sorts, radix selects), convolutions (cuDNN's ``fprop``, ``winograd``
and ``conv…`` kernels, ``aten::convolution`` on the CPU), Triton kernels (inductor's
``triton_…`` and omnirelay's own, named by their functions), copies and indexing (``copy``, ``index_put``, ``gather``, ``cat``, memcpy/memset), the
remaining elementwise and reduction kernels, and anything else. The first rule that
matches wins, in that order after inductor's (``gatherTopK`` is sampling, not a gather;
``…xmma_fprop_implicit_gemm…`` a convolution, not a GEMM).

:func:`census` sums a profile's kernels per family (launches and device time per step);
:func:`subtract` takes one census from another — the bench profiles the Talker's frame
alone and the whole step, and their difference is the tail and the host's part.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["FAMILIES", "census", "family", "kernel_rows", "render_census", "subtract"]

#: The families, in the order a census lists them.
FAMILIES = ("gemm", "conv", "attention", "norm", "sampling", "triton", "copy/index", "elementwise", "other")

# omnirelay's own Triton kernels (models/runner/moe_kernels.py, vocoder_kernels.py): the
# profiler names them by their function alone.
_OWN_TRITON = r"^(count_pairs|place_pairs|route|route_place|gate_up_silu|down_weighted|_snake_rows)$"

# (family, pattern) in the order they are tried, on the lower-cased name; inductor's own
# kernels first (its names carry the ops they fused: "triton_per_fused_index_put_…").
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("triton", re.compile(rf"^triton_|^triton::|{_OWN_TRITON}")),
    ("sampling", re.compile(r"topk|sort|radix|bitonic|multinomial|argmax|exponential_|sampl")),
    # before the GEMMs: cuDNN's implicit-GEMM convolutions carry "gemm" and "xmma" too
    ("conv", re.compile(r"conv(?!ert)|fprop|winograd|dgrad|wgrad|nchwtonhwc|nhwctonchw")),
    (
        "gemm",
        re.compile(
            r"nvjet|gemm|gemv|xmma|cutlass|cublas|splitk|"
            r"aten::(add|b)?mm$|aten::baddbmm|aten::matmul|aten::linear|aten::_grouped_mm"
        ),
    ),
    ("attention", re.compile(r"flash|fmha|attention|attn|softmax|sdpa|cudnn_mha")),
    ("norm", re.compile(r"norm")),
    (
        "copy/index",
        re.compile(
            r"copy|index|gather|scatter|catarray|aten::cat$|aten::stack$|memcpy|memset|"
            r"aten::clone$|aten::contiguous$|aten::embedding|aten::where$|take"
        ),
    ),
    ("elementwise", re.compile(r"elementwise|reduce|aten::")),
)


def family(name: str) -> str:
    """The family of a kernel (or ``aten`` operator) named ``name``."""
    low = name.lower()
    for fam, pattern in _RULES:
        if pattern.search(low):
            return fam
    return "other"


def kernel_rows(events: Iterable[Any], on_device: bool) -> list[tuple[str, int, float]]:
    """``(name, launches, device µs)`` of a profile's ``key_averages()``: its CUDA
    kernels on a GPU, its ``aten`` operators (self time) on the CPU — there an operator
    that calls others (``aten::linear`` → ``aten::addmm``) counts as well as they do."""
    rows = []
    for e in events:
        if on_device:
            if e.device_type.name != "CUDA":
                continue
            us = float(getattr(e, "device_time_total", 0.0))
        else:
            if not e.key.startswith("aten::"):
                continue
            us = float(e.self_cpu_time_total)
        if us > 0 or on_device:
            rows.append((str(e.key), int(e.count), us))
    return rows


def census(rows: Iterable[tuple[str, int, float]], steps: int) -> dict[str, dict[str, float]]:
    """Per family of :data:`FAMILIES` (each present, zero when empty), kernels and device
    milliseconds per step of ``rows`` (``(name, launches, µs)`` over ``steps`` steps),
    plus ``"total"``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    out = {fam: {"kernels": 0.0, "ms": 0.0} for fam in (*FAMILIES, "total")}
    for name, count, us in rows:
        for fam in (family(name), "total"):
            out[fam]["kernels"] += count / steps
            out[fam]["ms"] += us / steps / 1000.0
    return out


def subtract(
    whole: dict[str, dict[str, float]], part: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """``whole − part`` per family (the step's census less the frame's: the tail and host)."""
    return {
        fam: {k: v - part.get(fam, {}).get(k, 0.0) for k, v in figures.items()}
        for fam, figures in whole.items()
    }


def render_census(parts: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """A table, one line per family, one column pair (kernels, ms) per part of ``parts``."""
    names = list(parts)
    head = f"  {'family':<12}" + "".join(f" {name + ' kernels':>20} {'ms':>7}" for name in names)
    lines = [head]
    for fam in (*FAMILIES, "total"):
        cells = "".join(
            f" {parts[n].get(fam, {}).get('kernels', 0.0):>20.0f} {parts[n].get(fam, {}).get('ms', 0.0):>7.3f}"
            for n in names
        )
        lines.append(f"  {fam:<12}{cells}")
    return lines
