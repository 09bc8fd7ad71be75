"""The Talker's text mode: its first chunk built from the request's own prompt.

* :class:`TextConditioner` — for a text-to-speech pipeline whose first stage is the
  Talker (no Thinker stage): chunk 0 as the Thinker would have sent it, from the prompt's
  last user turn. :class:`~omnirelay.models.qwen3_omni.talker.TalkerExecutor` uses it with
  ``executor_args.text_input: true``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni.loader import Checkpoint
from omnirelay.models.qwen3_omni.talker_input import ThinkerChunk, assistant_start

if TYPE_CHECKING:
    from omnirelay.models.qwen3_omni.talker import TalkerSpec

__all__ = ["TextConditioner"]


class TextConditioner:
    """Text mode: the Talker's chunk 0 built from the request's own ChatML prompt, for a
    text-to-speech pipeline whose first stage is the Talker (no Thinker stage).

    The text to speak is the content of the prompt's last user turn (the serving layer's
    speech prompt: ``<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n``). It
    becomes the assistant turn, as if a Thinker had read it back verbatim: the rows are the
    Thinker's input embeddings (layer 0) of ``prompt + text``, which is all the Talker reads
    of text positions (accept-layer hidden states only matter at multimodal positions, and
    a text prompt has none). The stream is complete at once (``is_finished``): after the
    text the Talker is fed TTS EOS and speaks until its codec EOS.
    """

    def __init__(
        self, embed_tokens: Any, tts_token_ids: tuple[int, int, int], spec: TalkerSpec, im_end_token_id: int
    ) -> None:
        self.embed_tokens = embed_tokens
        self.spec = spec
        self.im_end_token_id = im_end_token_id
        with torch.inference_mode():
            weight = embed_tokens.weight
            rows = embed_tokens(torch.tensor(tts_token_ids, dtype=torch.long, device=weight.device))
        rows = rows.detach().to("cpu", torch.float32)
        self._tts = (rows[0:1], rows[1:2], rows[2:3])

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, spec: TalkerSpec) -> TextConditioner:
        """Only the Thinker's token embedding table is kept of the Thinker."""
        thinker = checkpoint.load_thinker()
        text = getattr(thinker.model, "language_model", thinker.model)
        embed_tokens = text.embed_tokens
        del thinker, text
        config = checkpoint.config
        tts = (int(config.tts_bos_token_id), int(config.tts_eos_token_id), int(config.tts_pad_token_id))
        return cls(embed_tokens, tts, spec, int(config.im_end_token_id))

    def spoken_ids(self, prompt: Sequence[int]) -> list[int]:
        """The content ids of the prompt's last user turn ([] when it has none)."""
        spec = self.spec
        start = None
        for i in range(len(prompt) - 2, -1, -1):
            if prompt[i] == spec.im_start_token_id and prompt[i + 1] == spec.user_token_id:
                start = i + 3  # <|im_start|> user \n
                break
        if start is None:
            return []
        out = []
        for token in prompt[start:]:
            if token in (self.im_end_token_id, spec.im_start_token_id):
                break
            out.append(int(token))
        return out

    def chunk(self, prompt_ids: Sequence[int], rid: str) -> ThinkerChunk:
        prompt = [int(t) for t in prompt_ids]
        start = assistant_start(prompt, self.spec.im_start_token_id, self.spec.assistant_token_id)
        if start is not None and start != len(prompt) - 3:
            # Generated codec ids follow the prompt: a recompute after preemption, which
            # restarts nothing here (the KV cache and the sampler state are gone).
            raise ModelError(
                f"request {rid!r}: a Talker request in text mode cannot be recomputed after preemption"
            )
        spoken = self.spoken_ids(prompt)
        if not spoken:
            raise ModelError(
                f"request {rid!r}: text mode needs a ChatML prompt with a non-empty user turn "
                "(<|im_start|>user\\n...<|im_end|>) ending in an open assistant turn; the serving layer's "
                "speech prompt is one"
            )
        ids = prompt + spoken
        weight = self.embed_tokens.weight
        with torch.inference_mode():
            rows = self.embed_tokens(torch.tensor(ids, dtype=torch.long, device=weight.device))
        rows = rows.detach().to("cpu", torch.float32)
        bos, eos, pad = self._tts
        return ThinkerChunk(
            is_finished=True,
            prefill_embed=rows,
            prefill_hidden=rows,
            token_ids=tuple(ids),
            prompt_ids=tuple(prompt),
            tts_bos=bos,
            tts_eos=eos,
            tts_pad=pad,
        )
