"""Chat prompts: the model's own chat template (jinja2, as Hugging Face renders it), or a plain
documented one for models without a template (such as ``orca-tiny``)."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

# One "role: content" line per message, then "assistant:" for the reply.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    # Hugging Face's variant: no HTML escaping (jinja2's own tojson escapes <, >, &).
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    """Compile once; ``render(messages)`` returns the prompt text. ``source`` None means the
    default template above."""

    def __init__(self, source: str | None = None, *, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.is_default = source is None
        self.source = DEFAULT_CHAT_TEMPLATE if source is None else source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=None, **self._specials)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, ValueError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") \
                from None
