"""``load_format: dummy``: a model built from its configuration alone, with random weights.

* :data:`FULL_SIZE_CONFIG` — the shipped configuration of Qwen3-Omni-30B-A3B (the
  checkpoint's own values; the library's ``Qwen3OmniMoeConfig()`` defaults are not that
  model). A stage with ``load_format: dummy`` and no ``model_dir``/``tiny`` builds this.
* :func:`build_part` — one part (Thinker, Talker, Code2Wav) of a config, allocated
  directly on the target device in the target dtype, every tensor initialized.

Its tokenizer is :func:`omnirelay.models.hf.dummy_tokenizer` (the config's special ids).

Why re-draw weights after the library's initializer: its ``_init_weights`` does not know
some parameter blocks (the Talker's routers and experts, the Thinker text model's down
projections in some releases), which keep whatever ``torch.empty`` left in memory — on a
GPU often zeros, so every token routes to the same experts and the timing of a dummy model
says nothing about the real one. Every MoE router and experts block is drawn again here
from the seeded generator (normal, ``initializer_range``). The vocoder gets variance-
preserving convolutions so that its output is audible noise, not 1e-7 (see
:func:`omnirelay.models.qwen3_omni.tiny.scale_code2wav`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from omnirelay.errors import ModelError

__all__ = [
    "FULL_SIZE_CONFIG",
    "DummyBuild",
    "build_part",
    "redraw_moe",
]

#: The shipped Qwen3-Omni-30B-A3B configuration (a checkpoint's ``config.json``).
FULL_SIZE_CONFIG = Path(__file__).with_name("configs") / "qwen3-omni-30b-a3b.json"


class DummyBuild:
    """What one dummy build took (for the stage's startup report)."""

    def __init__(self, part: str, seconds: float, num_params: int) -> None:
        self.part = part
        self.seconds = seconds
        self.num_params = num_params

    def __repr__(self) -> str:
        return f"{self.part}: {self.num_params / 1e9:.2f}B parameters in {self.seconds:.1f} s"


def redraw_moe(model: torch.nn.Module, std: float, generator: torch.Generator | None = None) -> int:
    """Draw every MoE router and experts block of ``model`` again (normal 0, ``std``);
    the number of tensors drawn."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("Experts") or name.endswith("TopKRouter"):
                for param in module.parameters(recurse=False):
                    param.normal_(0.0, std, generator=generator)
                    count += 1
    return count


def build_part(
    cls: Any, config: Any, *, part: str, device: torch.device, dtype: torch.dtype, seed: int
) -> Any:
    """``cls`` (a ``transformers`` model class) from ``config`` with random weights,
    allocated on ``device`` in ``dtype``; eval mode, no gradients. Deterministic for a
    seed, device and library version."""
    from omnirelay.models.hf import quiet_transformers
    from omnirelay.models.qwen3_omni.tiny import scale_code2wav

    start = time.monotonic()
    with quiet_transformers(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        try:
            with device:
                model = cls._from_config(config, dtype=dtype)
        except torch.OutOfMemoryError as exc:
            raise ModelError(f"the {part} does not fit on {device}: {exc}") from exc
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        redraw_moe(model, float(getattr(config, "initializer_range", 0.02)), generator)
        if part == "code2wav":
            scale_code2wav(model)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    num_params = sum(p.numel() for p in model.parameters())
    model.omnirelay_build = DummyBuild(part, time.monotonic() - start, num_params)
    return model
