"""The 12 Hz speech tokenizer's decoder (Qwen3-TTS's Code2Wav) as ``torch`` modules.

Parameter names are the checkpoint's under ``decoder.`` in ``speech_tokenizer/model.safetensors``.
One frame of ``Q`` codes (80 ms) becomes 1920 samples at 24 kHz:

1. **quantizer** — a split residual VQ: codebook 0 (the semantic one) and codebooks
   ``1 .. Q−1`` each look up a normalized codebook entry (``embedding_sum / cluster_usage``),
   summed per group and projected (1×1 convolutions) to ``codebook_dim``, then added;
2. **pre_conv** — a causal convolution (kernel 3) to ``latent_dim``;
3. **pre_transformer** — a sliding-window (``sliding_window`` frames) causal transformer
   with layer-scaled residuals, between an input and an output projection;
4. **upsample** — per ratio a non-overlapping transposed convolution and a ConvNeXt block
   (causal depthwise kernel 7);
5. **decoder** — a causal convolution, then per rate a SnakeBeta activation, a causal
   transposed convolution (kernel ``2r``, stride ``r``, the overlap trimmed at the right
   end only) and three dilated residual units; a last SnakeBeta and causal convolution to
   one channel, clamped to ±1.

Every step is causal — no sample depends on a later frame — so a window decodes with no
hold-back at its end (``T`` frames give exactly ``T · 1920`` samples), and the stateful
streaming decode of :class:`omnirelay.models.runner.vocoder.StreamingVocoder` applies with
a first chunk as long as any other (docs/protocol.md §6.2). Unlike Qwen3-Omni's Code2Wav,
whose up-sampling convolutions look one sample ahead, nothing is held back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omnirelay.models.qwen3_tts.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from omnirelay.models.qwen3_tts.model_config import CodecConfig

__all__ = ["CausalConvNet", "CausalTransConvNet", "SnakeBeta", "TTSCodec"]

_CODEBOOK_EPS = 1e-5
_SNAKE_EPS = 1e-9


class CausalConvNet(nn.Module):
    """A stride-1 convolution padded on the left only (``(kernel − 1) · dilation`` zeros)."""

    def __init__(self, cin: int, cout: int, kernel: int, *, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.stride = 1
        self.dilation = dilation
        self.padding = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(F.pad(x, (self.padding, 0)))
        return out


class CausalTransConvNet(nn.Module):
    """A transposed convolution (kernel ``k``, stride ``r``) whose ``k − r`` overlapping
    samples are cut at the right end: ``T`` inputs give ``T · r`` outputs, each block
    depending on its input and the one before (none after)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.left_pad = 0
        self.right_pad = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.conv(x)
        return y[..., : y.shape[-1] - self.right_pad] if self.right_pad else y


class SnakeBeta(nn.Module):
    """``x + sin²(x·e^α) / e^β`` per channel (``α``, ``β`` on a log scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.eps = _SNAKE_EPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp().view(1, -1, 1)
        beta = self.beta.exp().view(1, -1, 1)
        return x + torch.sin(x * alpha).pow(2) / (beta + self.eps)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConvNet(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 2, 1)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConvNet(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConvNet(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        units = [ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConvNet(cin, cout, 2 * rate, rate), *units])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        """The normalized entries ``[size, dim]``."""
        return self.embedding_sum / self.cluster_usage.clamp(min=_CODEBOOK_EPS).unsqueeze(1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes, self.table())


class _Quantization(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _Layers(nn.Module):
    def __init__(self, n: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Quantization(size, dim) for _ in range(n))


class ResidualQuantizer(nn.Module):
    """``n`` codebooks summed, projected from ``dim`` to ``out_dim`` (``input_proj`` is the
    encoder's direction, kept so the checkpoint's tensors load)."""

    def __init__(self, n: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = _Layers(n, size, dim)
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, n, T]`` → ``[B, out_dim, T]``."""
        total = None
        for i, layer in enumerate(self.vq.layers):
            codebook: _Codebook = layer._codebook  # type: ignore[assignment]
            part = codebook.decode(codes[:, i])
            total = part if total is None else total + part
        assert total is not None
        out: torch.Tensor = self.output_proj(total.transpose(1, 2))
        return out


class SplitQuantizer(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        dim = config.codebook_dim // 2
        self.rvq_first = ResidualQuantizer(1, config.codebook_size, dim, config.codebook_dim)
        self.rvq_rest = ResidualQuantizer(
            config.num_quantizers - 1, config.codebook_size, dim, config.codebook_dim
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])

    def frozen(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`decode` with every codebook's normalized table made once (the weights
        loaded) and stacked: one lookup for all the codebooks instead of a table and a
        lookup per codebook, then the same sums in the same order (the same values)."""
        layers = [*self.rvq_first.vq.layers, *self.rvq_rest.vq.layers]
        with torch.no_grad():
            tables = [layer._codebook.table() for layer in layers]
            table = torch.cat(tables)
        n, size = len(tables), tables[0].shape[0]
        offsets = (torch.arange(n, device=table.device) * size).view(1, n, 1)
        first, rest = self.rvq_first.output_proj, self.rvq_rest.output_proj

        def decode(codes: torch.Tensor) -> torch.Tensor:
            parts = F.embedding(codes + offsets, table)  # [B, Q, T, dim]
            total = parts[:, 1]
            for i in range(2, n):
                total = total + parts[:, i]
            out: torch.Tensor = first(parts[:, 0].transpose(1, 2)) + rest(total.transpose(1, 2))
            return out

        return decode


class CodecTransformer(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.config = config
        self.layers = nn.ModuleList(
            DecoderLayer(
                config.hidden_size,
                config.intermediate_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                eps=config.rms_norm_eps,
                qk_norm=False,
                bias=config.attention_bias,
                window=config.sliding_window,
                layer_scale=config.layer_scale_initial_scale,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, latent]`` at positions ``0 .. T−1`` → ``[B, T, latent]``."""
        b, t, _ = x.shape
        h = self.input_proj(x)
        positions = torch.arange(t, device=x.device).view(1, t).expand(b, t)
        cos, sin = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, cos, sin)
        out: torch.Tensor = self.output_proj(self.norm(h))
        return out


class TTSCodec(nn.Module):
    """``forward(codes [B, Q, T]) -> [B, 1, T · 1920]`` (see the module docstring)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.total_upsample = config.total_upsample
        self.quantizer = SplitQuantizer(config)
        self.pre_conv = CausalConvNet(config.codebook_dim, config.latent_dim, 3)
        self.pre_transformer = CodecTransformer(config)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    CausalTransConvNet(config.latent_dim, config.latent_dim, r, r),
                    ConvNeXtBlock(config.latent_dim),
                ]
            )
            for r in config.upsampling_ratios
        )
        blocks: list[nn.Module] = [CausalConvNet(config.latent_dim, config.decoder_dim, 7)]
        for i, rate in enumerate(config.upsample_rates):
            blocks.append(DecoderBlock(config.decoder_dim // 2**i, config.decoder_dim // 2 ** (i + 1), rate))
        out_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        blocks += [SnakeBeta(out_dim), CausalConvNet(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(blocks)

    # The streaming decoder's interface (omnirelay.models.runner.vocoder): the per-frame
    # front that needs no state, and the causal convolutions between it and the transformer.

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, Q, T]`` → the quantizer's latent ``[B, codebook_dim, T]``."""
        return self.quantizer.decode(codes)

    def stream_front(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`embed_codes` in fewer launches, its tables made now (``SplitQuantizer.frozen``)."""
        return self.quantizer.frozen()

    @property
    def frame_convs(self) -> list[CausalConvNet]:
        return [self.pre_conv]

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"expected {self.config.num_quantizers} codebooks, got {codes.shape[1]}")
        x = self.pre_conv(self.embed_codes(codes))
        x = self.pre_transformer(x.transpose(1, 2)).transpose(1, 2)
        for pair in self.upsample:
            x = pair[1](pair[0](x))  # type: ignore[index]
        for layer in self.decoder:
            x = layer(x)
        return x.clamp(min=-1, max=1)
