"""OpenAI tool calling for chat: checking ``tools`` and ``tool_choice``, putting the tools and
earlier calls and results into the conversation, the grammar that enforces ``"required"`` and a
named function, and parsing a reply into ``tool_calls`` (whole, or incrementally for streaming).

The reply format is Hermes's, which Qwen2.5-family templates ask for: one
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call; a reply that is one such
JSON object (or a list of them) and nothing else also counts. A chat template that uses
``tools`` gets them as transformers passes them; for one that does not (SmolLM2's), the tools
go into the system message as ``TOOLS_PROMPT`` followed by one JSON line per tool.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..sampling_params import StructuredOutputsParams
from .protocol import APIError, _short

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "You can call the functions below. To call one, reply with "
    f'{TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}'
    f"{TOOL_CALL_CLOSE}, one per call and nothing else. Functions (JSON):")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE),
                         re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (``index`` set: a streamed delta's)."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        return call if index is None else {"index": index, **call}


@dataclass
class ToolSetup:
    """A chat request's tools: the functions (OpenAI's ``function`` objects, checked), whether
    the reply may (``"auto"``) or must (``"required"``, or one named function) call them, and
    whether several calls are allowed."""

    functions: list[dict[str, Any]]
    choice: str  # "auto", "required" or a function's name
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """For ``"required"`` and a named function: a grammar that admits only tool calls whose
        arguments match the function's parameters (a Lark grammar with llguidance's inline
        ``%json`` schemas, JSON kept compact)."""
        if not self.forced:
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        schema = {"anyOf": [_call_schema(f) for f in chosen],
                  "x-guidance": {"whitespace_flexible": False}}
        repeat = "+" if self.parallel else ""
        lark = (f"start: call{repeat}\n"
                f"call: {json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}\n"
                f"body: %json {json.dumps(schema)}\n")
        return StructuredOutputsParams(grammar=lark)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content (None when only calls) and its tool calls; text that does not
        parse as calls of known functions stays content."""
        names = {f["name"] for f in self.functions}
        calls = []
        for block in _CALL_BLOCK.findall(text):
            call = _call_of(block, names)
            if call is None:
                return text, []
            calls.append(call)
        if calls:
            content = _CALL_BLOCK.sub("", text).strip()
            return content or None, calls if self.parallel else calls[:1]
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                return text, []
            items = value if isinstance(value, list) else [value]
            calls = [_call_of(item, names) for item in items]
            if calls and all(c is not None for c in calls):
                return None, calls if self.parallel else calls[:1]
        return text, []

    def held_back(self, text: str) -> int:
        """How much of a streamed reply's text so far may still turn out to be a tool call
        (kept back from content deltas): from an opening tag or a possible start of one, or all
        of it when it begins as JSON."""
        if text.lstrip()[:1] in ("{", "["):
            return len(text)
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            return len(text) - start
        for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if TOOL_CALL_OPEN.startswith(text[-size:]):
                return size
        return 0


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}}}


def _call_of(value: Any, names: set[str]) -> ToolCall | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def tool_setup(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None) -> ToolSetup | None:
    """The request's tools checked (400 naming ``tools`` or ``tool_choice``); None when the
    reply is plain text (no tools, or ``tool_choice`` "none")."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise APIError.bad_request("tool_choice needs tools", "tool_choice")
    if not tools or tool_choice == "none":
        return None
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise APIError.bad_request(f"tools[{i}] must be {{\"type\": \"function\", "
                                       f"\"function\": {{...}}}}, got {_short(tool)}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError.bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, "
                                       f"_ or -, got {name!r}", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError.bad_request(f"tools[{i}].function.parameters must be a JSON schema "
                                       f"object, got {_short(parameters)}", "tools")
        functions.append({"name": name, "description": function.get("description", ""),
                          "parameters": parameters or {"type": "object", "properties": {}}})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError.bad_request("tools: function names must be unique", "tools")
    if tool_choice in (None, "auto", "required"):
        choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise APIError.bad_request(f"tool_choice names the function {choice!r}, which is "
                                       "not in tools", "tool_choice")
    else:
        raise APIError.bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                                   "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                                   f"{_short(tool_choice)}", "tool_choice")
    return ToolSetup(functions, choice, parallel_tool_calls is not False)


def conversation(messages: list[dict[str, Any]], setup: ToolSetup | None,
                 template_uses_tools: bool) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The messages and the ``tools`` argument to render the prompt with. A template that uses
    tools gets them and the messages as they are (calls with their arguments as objects, as
    transformers passes them); otherwise calls become Hermes text, results
    ``<tool_response>`` user turns, and the tools a system message."""
    rendered = []
    for message in messages:
        calls = [_call_for_template(c) for c in message.get("tool_calls") or []]
        if template_uses_tools:
            rendered.append({**message, "tool_calls": calls} if calls else message)
        elif calls:
            text = "".join(f"{TOOL_CALL_OPEN}{json.dumps(c['function'])}{TOOL_CALL_CLOSE}"
                           for c in calls)
            rendered.append({"role": "assistant", "content": (message.get("content") or "")
                             + text})
        elif message["role"] == "tool":
            rendered.append({"role": "user", "content":
                             f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"})
        else:
            rendered.append(message)
    if setup is None:
        return rendered, None
    tools = [{"type": "function", "function": f} for f in setup.functions]
    if template_uses_tools:
        return rendered, tools
    listing = "\n".join(json.dumps(f) for f in setup.functions)
    system = f"{TOOLS_PROMPT}\n{listing}"
    if rendered and rendered[0]["role"] in ("system", "developer"):
        first = rendered[0]
        rendered[0] = {**first, "content": f"{first.get('content') or ''}\n\n{system}".lstrip()}
    else:
        rendered.insert(0, {"role": "system", "content": system})
    return rendered, None


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError.bad_request("messages: a tool call must be {\"type\": \"function\", "
                                   "\"function\": {\"name\", \"arguments\"}}, got "
                                   f"{_short(call)}", "messages")
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            raise APIError.bad_request("messages: a tool call's function.arguments must be "
                                       f"JSON text, got {_short(arguments)}", "messages") from None
    return {**call, "type": "function", "function": function}
