"""``python3 -m benchmarks.moe_block``: one Thinker MoE block on a GPU, each experts path.

The Qwen3-Omni Thinker's sparse MoE block at its real dims (128 experts, top-8, hidden
2048, expert intermediate 768), random bfloat16 weights, for a decode's 1 / 16 / 64
tokens and a prefill's 64 x 30: the fused path (:func:`~omnirelay.models.runner.moe.fused_moe_block`
as the runner calls it) against ``transformers``' ``batched_mm`` and ``grouped_mm``, each
replayed from a CUDA graph (median of ``--reps``), with its kernels per call
(``torch.profiler``), the bytes of the experts the tokens route to, the floor
(:mod:`benchmarks.floors`) and the fused output's relative error against ``grouped_mm``.

``--sweep`` also times the fused path with other block sizes
(:data:`SWEEP`, per token count's tile class), each checked against the default
tiles' output, so one run shows whether :func:`~omnirelay.models.runner.moe._tiles`
should change.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.floors import copy_bandwidth, count_kernels

__all__ = ["SWEEP", "main", "run_moe_block_bench"]

#: Candidate tiles per tile class: ``(bm, bn_up, bk_up, bn_down, bk_down, warps, stages)``.
SWEEP: dict[str, list[tuple[int, ...]]] = {
    "decode": [
        (16, 16, 128, 32, 128, 4, 4),
        (16, 32, 256, 64, 256, 4, 3),
        (16, 64, 128, 64, 128, 4, 4),
        (16, 32, 64, 32, 64, 2, 5),
    ],
    "prefill": [
        (64, 64, 64, 64, 64, 4, 4),
        (128, 128, 64, 128, 64, 8, 3),
        (64, 128, 32, 128, 32, 4, 4),
        (32, 64, 64, 128, 64, 4, 3),
    ],
}


def _block(device: torch.device) -> Any:
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as conf
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    config = conf.Qwen3OmniMoeTextConfig(
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    block = modeling.Qwen3OmniMoeThinkerTextSparseMoeBlock(config)  # type: ignore[arg-type]  # the text config is what it reads
    block = block.to(device, torch.bfloat16)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    return block


def _graph_ms(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    """Median ms of a CUDA graph replay of ``fn`` (compiled and warmed eagerly first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:]), out


def _figures(fn: Callable[[], torch.Tensor], reps: int, device: torch.device) -> dict[str, Any]:
    ms, out = _graph_ms(fn, reps)
    kernels = count_kernels(fn, torch.cuda.synchronize, device, steps=2)
    return {"graph_ms": ms, "kernels": kernels, "out": out.detach().float().clone()}


def run_moe_block_bench(tokens: tuple[int, ...], reps: int, sweep: bool) -> dict[str, Any]:
    from omnirelay.models.runner import moe

    device = torch.device("cuda:0")
    bandwidth = copy_bandwidth(device)
    block = _block(device)
    expert_bytes = block.experts.gate_up_proj[0].nbytes + block.experts.down_proj[0].nbytes
    assert moe.fused_experts_enabled(torch.bfloat16), "the fused path is off (triton, OMNIRELAY_FUSED_MOE)"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "bandwidth_bytes_per_s": bandwidth,
    }
    default_tiles = moe._tiles
    with torch.inference_mode():
        for n in tokens:
            x = torch.randn(1, n, 2048, device=device, dtype=torch.bfloat16)
            _, _, ids = block.gate(x.view(-1, 2048))
            nbytes = int(ids.unique().numel()) * expert_bytes + block.gate.weight.nbytes
            row: dict[str, Any] = {"bytes": nbytes, "floor_ms": 1000.0 * nbytes / bandwidth}
            paths = _paths(block, x)
            before = moe.CALLS["block"]
            results = {name: _figures(fn, reps, device) for name, fn in paths.items()}
            assert moe.CALLS["block"] > before, "the fused block did not run"
            base = results["grouped_mm"]["out"]
            for name, figures in results.items():
                out = figures.pop("out")
                figures["relative_to_grouped_mm"] = float((out - base).norm() / base.norm())
                row[name] = figures
            if sweep:
                row["sweep"] = _sweep(moe, default_tiles, results["fused"], paths["fused"], n, reps, device)
            report[f"tokens_{n}"] = row
    return report


def _paths(block: Any, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The block on ``x`` per experts path, as :data:`PATHS` names them."""
    from omnirelay.models.runner import moe
    from omnirelay.models.runner.decoder import experts_implementation
    from omnirelay.models.runner.fused import run_mlp

    def under(name: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with experts_implementation([block.experts], name):
                out: torch.Tensor = run_mlp(block, x) if name == moe.FUSED_EXPERTS else block(x)
                return out

        return call

    return {
        "batched_mm": under("batched_mm"),
        "grouped_mm": under("grouped_mm"),
        "fused": under(moe.FUSED_EXPERTS),
    }


def _sweep(
    moe: Any,
    default: Any,
    fused: dict[str, Any],
    fn: Callable[[], torch.Tensor],
    n: int,
    reps: int,
    device: Any,
) -> list[dict[str, Any]]:
    """The fused path with each candidate tile of ``n``'s class (the default's output as
    the reference: a candidate off by more than bfloat16 rounding is marked)."""
    kind = "decode" if n * 8 <= 1024 else "prefill"
    want = fn().float()
    rows = []
    for tiles in SWEEP[kind]:
        moe._tiles = lambda pairs, t=tiles: moe._Tiles(*t)
        try:
            ms, out = _graph_ms(fn, reps)
            error = float((out.float() - want).norm() / want.norm())
            rows.append({"tiles": list(tiles), "graph_ms": ms, "relative_to_default": error})
        except Exception as exc:  # a tile the compiler or the card refuses: listed, not fatal
            rows.append({"tiles": list(tiles), "error": f"{type(exc).__name__}: {exc}"[:200]})
        finally:
            moe._tiles = default
    rows.append({"tiles": "default", "graph_ms": fused["graph_ms"]})
    return rows


def render(report: dict[str, Any]) -> str:
    lines = [
        f"MoE block (128 experts, top-8, 2048 -> 768): {report['device']}, torch {report['torch']}, "
        f"bandwidth {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s\n",
        f"{'tokens':>7}{'floor ms':>10}  " + "".join(f"{p + ' ms':>15}{'kernels':>9}" for p in PATHS) + "\n",
    ]
    for key, row in report.items():
        if not key.startswith("tokens_"):
            continue
        line = f"{key[7:]:>7}{row['floor_ms']:>10.3f}  "
        line += "".join(f"{row[p]['graph_ms']:>15.3f}{row[p]['kernels']:>9.0f}" for p in PATHS)
        line += f"   fused vs grouped_mm {row['fused']['relative_to_grouped_mm']:.1e}"
        lines.append(line + "\n")
        for cand in row.get("sweep", []):
            figures = f"{cand['graph_ms']:.3f} ms" if "graph_ms" in cand else cand["error"]
            extra = f", rel. {cand['relative_to_default']:.1e}" if "relative_to_default" in cand else ""
            lines.append(f"{'':>7}  tiles {cand['tiles']}: {figures}{extra}\n")
    return "".join(lines)


PATHS = ("batched_mm", "grouped_mm", "fused")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.moe_block", description=__doc__)
    parser.add_argument("--tokens", default="1,16,64,1920", help="token counts, comma-separated")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time other fused tile sizes")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    tokens = tuple(int(t) for t in args.tokens.split(","))
    report = run_moe_block_bench(tokens, args.reps, args.sweep)
    print(render(report), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
