"""Operations of one stateful Code2Wav stream step, counted on the CPU.

``python -m benchmarks.code2wav_ops --decoder tts|omni --shapes 1x1,16x4,64x1 [--json PATH]``

A stream step replayed from a CUDA graph costs a fixed few milliseconds whatever its
batch: it is bound by the number of kernels it launches, one per aten operation that
computes (views launch nothing). This builds the shipped full-size decoder (Qwen3-TTS's
12 Hz decoder or Qwen3-Omni's Code2Wav) with random weights, runs one step of each
``streams x frames`` shape of :class:`~omnirelay.models.runner.vocoder.StreamingVocoder`
— the function its graphs capture — under a dispatch mode that counts the aten
operations by kind, and prints them by family (copies, element-wise, convolutions …)
and the most frequent. The count is the device's launch count up to the backends'
choices: the CPU picks ``mm``, ``addmm`` or a copy and ``bmm`` for a matrix product by
shape, and decomposes ``F.rms_norm`` into six operations where CUDA runs one fused
kernel (the "on CUDA" line counts it as one); on CUDA a convolution may add its bias
in a launch of its own, which neither line counts.

By default the tensors carry shapes only (``FakeTensorMode``), so even 64 streams count
in seconds; ``--real`` computes on CPU tensors. ``--json PATH`` also writes the counts
(``-``: the JSON alone, on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FAMILIES", "count_step", "family", "main"]

#: Operations that only re-describe memory: no kernel on any device.
_VIEWS = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "reshape",
        "transpose",
        "permute",
        "t",
        "expand",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "alias",
        "as_strided",
        "detach",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "empty",
        "empty_strided",
        "empty_like",
        "lift_fresh",
        "_local_scalar_dense",
    }
)
#: Each family's operations (an operation not named falls under ``elementwise``).
FAMILIES: dict[str, frozenset[str]] = {
    "conv": frozenset({"convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution"}),
    "matmul": frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul"}),
    "attention": frozenset(
        {
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "_softmax",
        }
    ),
    "copy": frozenset({"cat", "copy_", "clone", "contiguous", "_to_copy", "stack", "constant_pad_nd"}),
    "gather/scatter": frozenset(
        {"index_select", "index_copy_", "index_copy", "gather", "index", "index_put_", "scatter", "embedding"}
    ),
    "norm/reduce": frozenset({"mean", "sum", "native_layer_norm", "_fused_rms_norm", "norm", "amax"}),
    "create": frozenset(
        {"arange", "zeros", "zeros_like", "full", "fill_", "ones", "ones_like", "scalar_tensor"}
    ),
}


def family(name: str) -> str:
    """The family of an aten operation's base name (``"view"`` for those with no kernel)."""
    if name in _VIEWS:
        return "view"
    for fam, names in FAMILIES.items():
        if name in names:
            return fam
    return "elementwise"


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "aten":  # prim.device and the like are metadata queries
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Fused(TorchFunctionMode):
    """Counts what ``F.rms_norm`` decomposes into on the CPU: on CUDA it is one fused
    kernel (``_fused_rms_norm``), so a CUDA step launches that many fewer."""

    def __init__(self, ops: _Count) -> None:
        super().__init__()
        self.counter = ops
        self.calls = 0
        self.decomposed = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not F.rms_norm:
            return func(*args, **(kwargs or {}))
        before = sum(self.counter.ops.values())
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        self.decomposed += sum(self.counter.ops.values()) - before
        return out


def _decoder(name: str) -> Any:
    if name == "tts":
        from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs

        return TTSCheckpoint.open(TTSModelArgs(load_format="dummy", device="cpu")).load_codec()
    if name == "omni":
        from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint

        return open_checkpoint(ModelArgs(load_format="dummy", device="cpu")).load_code2wav()
    raise ValueError(f"unknown decoder {name!r}; choose tts or omni")


def count_step(vocoder: Any, streams: int, frames: int, *, fake: bool = True) -> tuple[Counter[str], int]:
    """The aten operations of one stream step of ``streams`` rows of ``frames`` new frames
    (every row a continuing stream), by name: what the step's graph would launch; and how
    many fewer a CUDA device launches (each ``F.rms_norm`` one kernel there)."""
    codes = torch.zeros((streams, vocoder.q, frames), dtype=torch.long)
    slots = torch.arange(streams, dtype=torch.long)
    counts = torch.full((streams,), frames, dtype=torch.long)
    positions = torch.full((streams,), 8, dtype=torch.long)
    mode = _Count()
    fused = _Fused(mode)
    # no_grad, not inference_mode: under inference_mode a dispatch mode also sees the
    # composite operations (linear, conv1d, to) before they decompose into kernels.
    with torch.no_grad():
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
                inputs = [fake_mode.from_tensor(x) for x in (codes, slots, counts, positions)]
                with fused, mode:
                    vocoder._forward(*inputs)
        else:
            with fused, mode:
                vocoder._forward(codes, slots, counts, positions)
    return mode.ops, fused.decomposed - fused.calls


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            b, t = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: expected STREAMSxFRAMES, got {part!r}") from None
        if b < 1 or t < 1:
            raise SystemExit(f"--shapes: streams and frames must be >= 1, got {part!r}")
        out.append((b, t))
    return out


def report(decoder: str, shapes: Sequence[tuple[int, int]], *, fake: bool = True) -> dict[str, Any]:
    """Each shape's operations: kernels (every operation but views), by family, by name."""
    from omnirelay.models.runner.vocoder import StreamingVocoder

    model = _decoder(decoder)
    vocoder = StreamingVocoder(model, max_streams=max(b for b, _ in shapes), cuda_graphs=False)
    out: dict[str, Any] = {"decoder": decoder, "torch": torch.__version__, "shapes": {}}
    for b, t in shapes:
        ops, fewer_on_cuda = count_step(vocoder, b, t, fake=fake)
        families: Counter[str] = Counter()
        for name, n in ops.items():
            families[family(name)] += n
        kernels = sum(n for name, n in ops.items() if family(name) != "view")
        out["shapes"][f"{b}x{t}"] = {
            "kernels": kernels,
            "cuda_kernels": kernels - fewer_on_cuda,
            "views": families.pop("view", 0),
            "families": dict(families.most_common()),
            "ops": dict(ops.most_common()),
        }
    return out


def render(result: dict[str, Any], top: int = 15) -> str:
    shapes = result["shapes"]
    names = list(shapes)
    fams = sorted(
        {f for s in shapes.values() for f in s["families"]},
        key=lambda f: -shapes[names[0]]["families"].get(f, 0),
    )
    width = max(10, *(len(n) + 2 for n in names))
    lines = [f"Code2Wav stream step ({result['decoder']}), aten operations per step, torch {result['torch']}"]
    lines.append(f"{'family':<18}" + "".join(f"{n:>{width}}" for n in names))
    for fam in fams:
        lines.append(f"{fam:<18}" + "".join(f"{shapes[n]['families'].get(fam, 0):>{width}}" for n in names))
    lines.append(f"{'kernels':<18}" + "".join(f"{shapes[n]['kernels']:>{width}}" for n in names))
    lines.append(f"{'  on CUDA':<18}" + "".join(f"{shapes[n]['cuda_kernels']:>{width}}" for n in names))
    lines.append(f"{'(views)':<18}" + "".join(f"{shapes[n]['views']:>{width}}" for n in names))
    first = shapes[names[0]]["ops"]
    lines.append(f"top operations ({names[0]}):")
    ranked = [(op, n) for op, n in first.items() if family(op) != "view"][:top]
    lines += [f"  {op:<40}{n:>6}  {family(op)}" for op, n in ranked]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.code2wav_ops", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--decoder", choices=("tts", "omni"), default="tts")
    parser.add_argument("--shapes", default="1x1,16x4,64x1", help="STREAMSxFRAMES, comma-separated")
    parser.add_argument("--json", metavar="PATH", help="also write the counts as JSON ('-': stdout only)")
    parser.add_argument(
        "--real", action="store_true", help="compute on real CPU tensors instead of fake ones"
    )
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    result = report(args.decoder, _shapes(args.shapes), fake=not args.real)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    print(render(result, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
