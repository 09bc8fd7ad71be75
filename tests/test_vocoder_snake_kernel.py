"""The SnakeBeta activation as one Triton kernel (:mod:`omnirelay.models.runner.vocoder_kernels`)
computes what the decoders' own modules compute.

* CPU, where ``triton`` is importable: the kernel under the Triton interpreter in
  float32, for Qwen3-TTS's SnakeBeta (divides) and ``transformers``' (multiplies by the
  inverse), rows shorter than a block and longer than one, a non-contiguous input: within
  1e-6 of the module.
* GPU: the same compiled against the module in float32, for float32 (within 1e-5: the
  device's ``sin``) and bfloat16 input (within one bfloat16 rounding), and replayed from
  a CUDA graph. The streaming vocoder picks it on CUDA unless ``OMNIRELAY_FUSED_SNAKE=0``.

Skipped with a reason where ``triton`` (CPU part) or CUDA (GPU part) is missing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

from omnirelay.models.qwen3_tts.codec import SnakeBeta
from omnirelay.models.runner import vocoder_ops as ops
from tests.triton_support import HAS_TRITON, interpreted_import, needs_triton

KERNELS = "omnirelay.models.runner.vocoder_kernels"
needs_cuda = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton"
)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from interpreted_import(KERNELS, monkeypatch)


def _modules(channels: int, device: str, dtype: torch.dtype) -> list[torch.nn.Module]:
    gen = torch.Generator().manual_seed(0)
    modules: list[torch.nn.Module] = [SnakeBeta(channels), omni.Qwen3OmniMoeSnakeBeta(channels)]
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return [m.to(device, dtype) for m in modules]


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@needs_triton
@pytest.mark.parametrize("width", [40, 1500])
def test_the_interpreted_kernel_is_the_modules_activation(interpreted: Any, width: int) -> None:
    x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(1)) * 3
    for module in _modules(3, "cpu", torch.float32):
        fused = ops.snake(module, kernel=True)
        with torch.no_grad():
            assert _worst(fused(x), module(x)) < 1e-6
            strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, not contiguous
            assert _worst(fused(strided), module(x)) < 1e-6


def test_the_kernel_is_chosen_on_cuda_only_and_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops.FUSED_SNAKE_ENV, raising=False)
    assert not ops.snake_kernel_enabled(torch.device("cpu"))
    assert ops.snake_kernel_enabled(torch.device("cuda:0")) == HAS_TRITON
    monkeypatch.setenv(ops.FUSED_SNAKE_ENV, "0")
    assert not ops.snake_kernel_enabled(torch.device("cuda:0"))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernel_is_the_modules_activation_in_a_graph(dtype: torch.dtype) -> None:
    """Against the module in float32: the kernel within 1e-5 (float32: the device's
    ``sin``) or one bfloat16 rounding of its output (bfloat16: it computes in float32 and
    rounds once, where the module in bfloat16 rounds each of its steps)."""
    x = torch.randn(4, 96, 7680, device="cuda:0", dtype=dtype) * 3
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    for module in _modules(96, "cuda:0", dtype):
        fused = ops.snake(module, kernel=True)
        exact = copy.deepcopy(module).float()
        with torch.no_grad():
            got = fused(x)
            print(
                f"{type(module).__name__} {dtype}: kernel {_worst(got, exact(x.float())):.1e}, "
                f"module {_worst(module(x), exact(x.float())):.1e} from float32"
            )
            assert _worst(got, exact(x.float())) < tolerance
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused(x)
            x.mul_(0.5)
            graph.replay()
            assert _worst(out, exact(x.float())) < tolerance
