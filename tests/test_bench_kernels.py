"""The bench's kernel census: kernel names sorted into families, counted and timed per
step, one part's census taken from another's (on fake profiler events: the names are
those an H100 profile of the Talker step shows)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from benchmarks.kernels import FAMILIES, census, family, kernel_rows, render_census, subtract


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
        ("aten::addmm", "gemm"),
        ("aten::mm", "gemm"),
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "conv"),
        ("void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16>", "conv"),
        ("winograd_nonfused::winogradForwardData4x4", "conv"),
        ("aten::convolution", "conv"),
        ("void at::native::unrolled_elementwise_kernel<convert_float_to_bf16>", "elementwise"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
        ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false>", "attention"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "norm"),
        ("aten::rms_norm", "norm"),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "sampling"),
        ("void at::native::radixSortKVInPlace<-2, -1, 16, 4, float, long>", "sampling"),
        ("aten::topk", "sampling"),
        ("triton_per_fused_index_put_mul_rsqrt_0", "triton"),
        ("triton_tem_fused_mm_1", "triton"),
        ("_snake_rows", "triton"),
        ("gate_up_silu", "triton"),
        ("void at::native::index_put_kernel_impl<at::native::OpaqueType<2>>", "copy/index"),
        ("void at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)", "copy/index"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<long, unsigned int, 1>", "copy/index"),
        ("Memcpy HtoD (Pinned -> Device)", "copy/index"),
        ("aten::index_select", "copy/index"),
        ("void at::native::elementwise_kernel<128, 2, BinaryFunctor<c10::BFloat16>>", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "elementwise"),
        ("aten::mul", "elementwise"),
        ("void cub::DeviceScanKernel<int>", "other"),
    ],
)
def test_each_kernel_name_falls_in_its_family(name: str, want: str) -> None:
    assert family(name) == want


def test_a_census_counts_and_times_per_step_and_parts_subtract() -> None:
    steps = 2
    step = [
        ("nvjet_tst_64x8", 98 * steps, 2000.0),
        ("void at::native::sbtopk::gatherTopK<float>", 15 * steps, 660.0),
        ("triton_poi_fused_add_0", 300 * steps, 900.0),
        ("void at::native::index_put_kernel_impl<>", 56 * steps, 100.0),
    ]
    frame = [
        ("nvjet_tst_64x8", 84 * steps, 1500.0),
        ("void at::native::index_put_kernel_impl<>", 56 * steps, 100.0),
    ]
    whole, part = census(step, steps), census(frame, steps)
    assert set(whole) == {*FAMILIES, "total"}
    assert whole["gemm"] == {"kernels": 98.0, "ms": pytest.approx(1.0)}
    assert whole["sampling"]["kernels"] == 15.0 and whole["triton"]["kernels"] == 300.0
    assert whole["total"]["kernels"] == 98 + 15 + 300 + 56
    assert whole["attention"] == {"kernels": 0.0, "ms": 0.0}
    tail = subtract(whole, part)
    assert tail["gemm"]["kernels"] == 14.0 and tail["gemm"]["ms"] == pytest.approx(0.25)
    assert tail["copy/index"]["kernels"] == 0.0
    assert tail["total"]["kernels"] == 98 + 15 + 300 + 56 - 84 - 56
    lines = render_census({"frame": part, "tail": tail})
    assert "frame kernels" in lines[0] and "tail kernels" in lines[0]
    assert any(line.split()[:2] == ["gemm", "84"] for line in lines)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        census(step, 0)


@dataclass
class _DeviceType:
    name: str


@dataclass
class _Event:
    key: str
    count: int
    device_type: _DeviceType
    device_time_total: float = 0.0
    self_cpu_time_total: float = 0.0


def test_kernel_rows_keep_a_gpu_profiles_kernels_and_a_cpu_profiles_operators() -> None:
    events = [
        _Event("nvjet_tst", 4, _DeviceType("CUDA"), device_time_total=40.0),
        _Event("cudaGraphLaunch", 2, _DeviceType("CPU"), self_cpu_time_total=30.0),
        _Event("aten::mm", 3, _DeviceType("CPU"), self_cpu_time_total=12.0),
    ]
    assert kernel_rows(events, on_device=True) == [("nvjet_tst", 4, 40.0)]
    assert kernel_rows(events, on_device=False) == [("aten::mm", 3, 12.0)]
