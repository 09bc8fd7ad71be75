"""The Qwen3-TTS Talker and its code predictor as ``torch`` modules.

Parameter names are the checkpoint's under ``talker.`` (``talker.model.layers.0.mlp.up_proj.weight``,
``talker.code_predictor.lm_head.3.weight`` …), so a checkpoint's weights load by name.

* :class:`TTSTalkerModel` — the Talker's decoder: a Qwen3 stack (q/k norms, grouped-query
  attention, SwiGLU) with the codec embedding table (codebook 0 and every codec special
  id: speakers, languages, think/pad/BOS/EOS) and the text embedding table.
* :class:`TTSCodePredictor` — the small decoder that samples codebooks ``1 .. Q−1``: its
  input is the Talker's hidden state, then each sampled codebook's embedding (one table
  per codebook, in the Talker's width), projected to its own width when the two differ
  (``small_to_mtp_projection``; the 1.7B model's 2048 → 1024); one head per codebook.
* :class:`TTSTalker` — the two, with ``text_projection`` (text embeddings → the Talker's
  width, a two-layer SiLU MLP) and ``codec_head`` (the first codebook's logits).

The runner (:mod:`omnirelay.models.runner`) runs these modules step by step over its
static caches; :meth:`TTSTalker.prefill_logits` and :meth:`TTSTalker.predictor_logits` are
the full-sequence forwards the equivalence tests compare with the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnirelay.models.qwen3_tts.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from omnirelay.models.qwen3_tts.model_config import PredictorConfig, TalkerConfig

__all__ = ["TTSCodePredictor", "TTSTalker", "TTSTalkerModel", "TextProjection"]


class _Stack(nn.Module):
    """A Qwen3 decoder stack: ``layers``, the final ``norm`` and ``rotary_emb``."""

    def __init__(self, config: TalkerConfig | PredictorConfig) -> None:
        super().__init__()
        self.config = config
        assert config.head_dim is not None
        self.layers = nn.ModuleList(
            DecoderLayer(
                config.hidden_size,
                config.intermediate_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                eps=config.rms_norm_eps,
                qk_norm=True,
                bias=config.attention_bias,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds [B, T, H]`` at positions ``0 .. T−1`` → normed hidden states ``[B, T, H]``."""
        b, t, _ = embeds.shape
        positions = torch.arange(t, device=embeds.device).view(1, t).expand(b, t)
        cos, sin = self.rotary_emb(embeds, positions)
        h = embeds
        for layer in self.layers:
            h = layer(h, cos, sin)
        out: torch.Tensor = self.norm(h)
        return out


class TTSTalkerModel(_Stack):
    config: TalkerConfig

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__(config)
        self.codec_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.text_hidden_size)


class _PredictorModel(_Stack):
    config: PredictorConfig

    def __init__(self, config: PredictorConfig, embedding_dim: int) -> None:
        super().__init__(config)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, embedding_dim) for _ in range(config.num_code_groups - 1)
        )


class TTSCodePredictor(nn.Module):
    def __init__(self, config: PredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.config = config
        self.model = _PredictorModel(config, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            for _ in range(config.num_code_groups - 1)
        )
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, config.hidden_size, bias=True)
            if config.hidden_size != talker_hidden
            else nn.Identity()
        )


class TextProjection(nn.Module):
    """Text embeddings (``text_hidden_size``) → the Talker's width."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(F.silu(self.linear_fc1(x)))
        return out


class TTSTalker(nn.Module):
    """The Talker with its code predictor (see the module docstring)."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TTSTalkerModel(config)
        self.text_projection = TextProjection(config.text_hidden_size, config.hidden_size)
        self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.code_predictor = TTSCodePredictor(config.code_predictor_config, config.hidden_size)

    # ----------------------------------------------------------------- embeddings

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Projected text embeddings of ``ids`` (any shape) → ``[..., H]``."""
        out: torch.Tensor = self.text_projection(self.model.text_embedding(ids))
        return out

    def codec_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec embeddings (codebook 0 and the special ids) of ``ids`` → ``[..., H]``."""
        out: torch.Tensor = self.model.codec_embedding(ids)
        return out

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """The sum of a frame's ``Q`` codec embeddings (``codes [B, Q]`` → ``[B, H]``): the
        next step's codec input."""
        total = self.codec_rows(codes[:, 0])
        for g, table in enumerate(self.code_predictor.model.codec_embedding):
            total = total + table(codes[:, g + 1])
        return total

    # ----------------------------------------------------------------- full forwards (tests)

    def prefill_logits(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds [B, T, H]`` → (first-codebook logits ``[B, T, vocab]`` float32, hidden ``[B, T, H]``)."""
        hidden = self.model(embeds)
        return self.codec_head(hidden).float(), hidden

    def predictor_logits(self, hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of codebooks ``1 .. Q−1`` ``[B, Q−1, codebook]`` (float32)
        given the Talker's hidden states ``[B, H]`` and the frames' codes ``[B, Q]``."""
        predictor = self.code_predictor
        rows = [hidden.unsqueeze(1), self.codec_rows(codes[:, :1])]
        for g in range(codes.shape[1] - 2):
            rows.append(predictor.model.codec_embedding[g](codes[:, g + 1 : g + 2]))
        h = predictor.model(predictor.small_to_mtp_projection(torch.cat(rows, dim=1)))
        logits = [predictor.lm_head[g](h[:, g + 1]) for g in range(codes.shape[1] - 1)]
        return torch.stack(logits, dim=1).float()
