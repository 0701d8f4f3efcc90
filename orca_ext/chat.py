"""Chat prompts: a chat template (jinja2, rendered as Hugging Face renders it), the model's own
or one given with ``orca-serve --chat-template`` / ``LLM.chat(chat_template=...)``. A model
without one (a base model such as Gemma 3 270M) has no chat: rendering for it raises
``NoChatTemplateError``, which says how to give a template."""
from __future__ import annotations

import codecs
import json
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model.loader import ModelInfo

NO_CHAT_TEMPLATE = (
    "the model has no chat template (it is probably a base model, not a chat model): give one "
    "as a Jinja template, as in a Hugging Face tokenizer_config.json, with orca-serve "
    "--chat-template FILE_OR_TEXT or LLM.chat(..., chat_template=TEXT), or send the prompt "
    "text to the completions API")
# A --chat-template value holding none of these is a file name (vLLM's rule).
_JINJA_CHARS = "{}\n"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


class NoChatTemplateError(ValueError):
    """A chat request to a model that has no chat template, and none was given."""

    def __init__(self) -> None:
        super().__init__(NO_CHAT_TEMPLATE)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s value as vLLM reads it: the text of the file it names, or else the
    template itself (with backslash escapes such as ``\\n`` decoded, so that a template fits on
    a command line); a value without Jinja's characters must name a readable file."""
    if value is None:
        return None
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file name but does not "
                             f"read as one ({exc}); give a Jinja file or the template's "
                             "text") from None
    # Non-ASCII characters go through as \u escapes, so that decoding keeps them.
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    # Hugging Face's variant: no HTML escaping (jinja2's own tojson escapes <, >, &).
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    """Compile once; ``render(messages)`` returns the prompt text. ``source`` None means the
    model has no template: ``render`` raises ``NoChatTemplateError``."""

    def __init__(self, source: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self._template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(source)
            except TemplateError as exc:
                raise ValueError(f"the chat template does not compile: {exc}") from None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @classmethod
    def for_model(cls, info: ModelInfo, source: str | None = None) -> ChatTemplate:
        """The template chat requests to the model ``info`` describes render with: ``source``
        (a template's text) if given, else the model's own; its ``bos_token`` and
        ``eos_token`` are the tokenizer's."""
        def token(token_id: int | None) -> str | None:
            if token_id is None or info.tokenizer is None:
                return None
            return info.tokenizer.id_to_token(token_id)

        return cls(info.chat_template if source is None else source,
                   bos_token=token(info.bos_token_id), eos_token=token(info.eos_token_id))

    @property
    def uses_tools(self) -> bool:
        """Whether the template renders ``tools`` itself (as Hugging Face's tool-calling
        templates do)."""
        return self.source is not None and re.search(r"\btools\b", self.source) is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        if self._template is None:
            raise NoChatTemplateError()
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self._specials)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, ValueError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") \
                from None
