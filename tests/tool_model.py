"""A test model that calls tools: a real chat template that takes tools, and a scripted answer.

:class:`ScriptedToolModel` is a :class:`~omnirelay.models.family.PromptSide` for a server
over the toy pipeline (``create_app(..., prompts=...)``): its prompts are rendered by a
``transformers`` tokenizer's chat template written the way Qwen's is (Hermes-style: the
tools in the system turn, calls as ``<tool_call>{...}</tool_call>``, tool results as
``<tool_response>`` user turns), and its "model" answers by the prompt it was given (its
detokenizer ignores the toy's generated ids and writes the script a few characters a
token, so tags are split across deltas):

* the prompt ends with a tool result → a final answer that quotes it;
* tools are defined and the user asks about weather → a call of ``get_weather`` for each
  city named (Paris, Rome), after a short sentence; an assistant turn the server started
  with a call's opening (``tool_choice``) is continued from there;
* otherwise → a plain answer.

Every prompt it rendered is kept in :attr:`ScriptedToolModel.rendered`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from omnirelay.models.family import Detokenizer, PromptSide, SpeechPrompt
from omnirelay.models.tools import ChatTemplateTools

#: A Hermes-style chat template (the shape of Qwen2.5's).
TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures are within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, return {"name": <function-name>, "arguments": <args-json-object>} within \
<tool_call></tool_call> tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>
{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CHARS_PER_TOKEN = 3
PLAIN_ANSWER = "Hello there."


def make_tokenizer(template: str | None = TEMPLATE) -> Any:
    """A byte-level tokenizer (no merges) with ChatML's special tokens and ``template``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, eos_token="<|im_end|>")


def answer_for(prompt: str) -> str:
    """The scripted answer to a rendered prompt (see the module docstring)."""
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "<tool_response>" in last_user:
        result = last_user.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        return f"The tool says: {result}"
    if "<tools>" not in prompt or "weather" not in last_user:
        return PLAIN_ANSWER
    cities = [c for c in ("Paris", "Rome") if c in last_user]
    if prompt.endswith('"arguments": '):  # a named tool_choice: the arguments are next
        return json.dumps({"city": cities[0]}) + "}\n</tool_call>"
    calls = [
        "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": c}}) + "\n</tool_call>"
        for c in cities
    ]
    if prompt.endswith("<tool_call>\n"):  # tool_choice required: the first call is open
        return "\n".join(calls)[len("<tool_call>\n") :]
    return "Let me check.\n" + "\n".join(calls)


class _Script:
    def __init__(self, text: str) -> None:
        self._text = text

    def push(self, token_ids: Sequence[int]) -> str:
        n = CHARS_PER_TOKEN * len(token_ids)
        piece, self._text = self._text[:n], self._text[n:]
        return piece

    def flush(self) -> str:
        return ""


class ScriptedToolModel(PromptSide):
    """The test model (see the module docstring)."""

    def __init__(self, template: str | None = TEMPLATE) -> None:
        self.tokenizer = make_tokenizer(template)
        self.chat_tools = ChatTemplateTools(self.tokenizer.apply_chat_template)
        self.rendered: list[str] = []

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        messages = [{"role": role, "content": text} for role, text in turns]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode_rendered(str(text))

    def encode_rendered(self, text: str) -> list[int]:
        self.rendered.append(text)
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def speech_prompt(
        self,
        text: str,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
    ) -> SpeechPrompt:
        return SpeechPrompt(self.encode_chat([("user", text)]))

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return _Script(answer_for(self.tokenizer.decode(list(context), skip_special_tokens=False)))
