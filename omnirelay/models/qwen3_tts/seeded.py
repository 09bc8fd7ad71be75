"""Seeded random weights keyed by parameter name: the same tensors in any implementation.

:func:`seeded_tensor` draws one parameter from a generator seeded by its *name* (the
checkpoint's key, ``talker.model.layers.0.self_attn.q_proj.weight``) and the seed, so two
implementations of the same architecture — omnirelay's and the reference package, in
its own environment — get identical weights without any weight file changing hands:
only the names and shapes have to agree, which is what loading a real checkpoint needs
too. The reference fixtures (``tests/fixtures/qwen3_tts/make_fixtures.py``) load this
file by path, so it imports nothing but ``torch`` and the standard library.

The scales keep a random model's activations in a sane range (audible noise from the
decoder, logits that are not all ties): matrices are variance-preserving over their
fan-in (``gain / sqrt(fan_in)``, half for the vocoder's convolutions, whose residual
chains add up), embeddings unit normal (codebook sums a quarter), norm weights near one, biases
and the vocoder's log-scale activation parameters small, codebook usage positive.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import torch

__all__ = ["RECIPE_VERSION", "fill_seeded", "seeded_tensor"]

#: Bump when the draw of any tensor changes (the fixtures must then be made again).
RECIPE_VERSION = 1


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) << 16) ^ seed)


def seeded_tensor(
    name: str, shape: Iterable[int], seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The float32 value of parameter ``name`` of ``shape``, from ``seed``, drawn on
    ``device`` (each device's generator draws its own values; the CPU's are the fixtures')."""
    size = tuple(int(s) for s in shape)
    dev = torch.device(device)
    gen = _generator(name, seed, dev)
    leaf = name.rsplit(".", 1)[-1]
    normal = torch.randn(size, generator=gen, dtype=torch.float32, device=dev)
    if leaf == "cluster_usage":
        return 0.5 + torch.rand(size, generator=gen, dtype=torch.float32, device=dev)
    if leaf in ("alpha", "beta"):  # SnakeBeta's log-scale frequency and magnitude
        return 0.1 * normal
    if leaf == "gamma" or leaf == "scale":  # ConvNeXt and transformer layer scales
        return 0.1 + 0.01 * normal
    if leaf == "bias":
        return 0.02 * normal
    if len(size) == 1:  # norm weights
        return 1.0 + 0.1 * normal
    if leaf == "embedding_sum":  # 16 codebooks are summed
        return 0.25 * normal
    if "embed" in name:
        return normal
    fan_in = math.prod(size[1:])
    # Convolutions sit in residual chains that add up: half the variance-preserving gain.
    gain = 0.5 if len(size) == 3 else 1.0
    return gain * normal / math.sqrt(max(1, fan_in))


def fill_seeded(
    params: Mapping[str, torch.Tensor], seed: int = 0, *, prefix: str = "", on_device: bool = False
) -> None:
    """Overwrite every tensor of ``params`` (``module.state_dict(keep_vars=True)`` or
    ``named_parameters()``) in place with :func:`seeded_tensor` of ``prefix + name``,
    drawn on the CPU (the same values everywhere) or, ``on_device``, where each tensor is
    (fast for a full-size model on a GPU)."""
    with torch.no_grad():
        for name, tensor in params.items():
            device = tensor.device if on_device else torch.device("cpu")
            value = seeded_tensor(prefix + name, tensor.shape, seed, device)
            tensor.copy_(value.to(dtype=tensor.dtype, device=tensor.device))
