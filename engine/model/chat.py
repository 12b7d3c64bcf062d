"""Chat templates: turning system / user / assistant turns into the prompt text a chat model was trained on.

A chat model does not read bare text: SmolLM2-Instruct expects ChatML (``<|im_start|>user\\n...<|im_end|>\\n``) and
answers after ``<|im_start|>assistant\\n``. The template ships with the model (``tokenizer_config.json``'s
``chat_template``, from the GGUF file's ``tokenizer.chat_template``) as Jinja source. It is rendered with jinja2's
sandbox, the way transformers' ``apply_chat_template`` renders it, so a prompt here is the prompt transformers would
build. jinja2 is already installed wherever torch is (torch depends on it), so this adds no dependency.

Replies (``Engine.continue_conversation``) need only what comes after the history: the end of the assistant's turn
(unless the model already wrote it, as its end-of-sequence token), the new user turn and the assistant header.
:meth:`ChatTemplate.reply_text` finds that text from the template itself, by rendering a conversation with and
without a following user turn and keeping the difference.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import EngineError

ROLES = ("system", "user", "assistant")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a list of {"role", "content"} dicts, or an EngineError saying what is wrong."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise EngineError("messages must be a non-empty list of {'role': ..., 'content': ...} turns")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise EngineError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise EngineError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise EngineError(f"message {i}: content must be text, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


class ChatTemplate:
    """A model's Jinja chat template, compiled once in jinja2's sandbox (templates come with downloaded files)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise EngineError("rendering the model's chat template needs jinja2 (pip install jinja2)") from None

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise EngineError(f"the model's chat template cannot be read: {exc}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``; with ``add_generation_prompt`` it ends where the assistant answers."""
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=check_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise EngineError(f"the model's chat template refused these messages: {exc}") from None

    def reply_text(self, content: str, ended_with_eos: bool) -> str:
        """What to append to a conversation whose last turn was the assistant's, for a new user turn ``content`` and
        the next assistant answer. ``ended_with_eos``: the assistant's output ended with the end-of-sequence token, so
        that much of the turn's closing is written already."""
        if not isinstance(content, str):
            raise EngineError("a reply must be text")
        marker = "\x00ASSISTANT\x00"  # stands for the assistant's words, which the history already holds
        history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
        before = self.render(history, add_generation_prompt=False)
        after = self.render(history + [{"role": "user", "content": content}], add_generation_prompt=True)
        if not after.startswith(before) or marker not in before:
            raise EngineError("the model's chat template does not extend a conversation turn by turn; reply with "
                              "prompt_token_ids instead")
        closing = before[before.index(marker) + len(marker):]  # e.g. "<|im_end|>\n"
        if ended_with_eos and self.eos_token and closing.startswith(self.eos_token):
            closing = closing[len(self.eos_token):]
        return closing + after[len(before):]
