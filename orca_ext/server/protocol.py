"""OpenAI-compatible request and response models (pydantic), errors, and response builders.

Requests are validated in two steps: pydantic checks the JSON types (strict: ``"5"`` is not an
integer), then ``SamplingParams`` checks the ranges and supplies the defaults of the fields a
client left out. Every failure is an ``APIError`` whose body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``. The response models only describe the
responses in the OpenAPI document; the responses themselves are built as plain dicts below.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json

from ..detokenizer import TokenText
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_N = 128  # samples per prompt
MAX_PROMPTS = 256  # prompts in one /v1/completions request

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def bad_request(cls, message: str, param: str | None = None,
                    code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_value_error(cls, exc: Exception) -> APIError:
        """A ValueError of the engine or of SamplingParams ("field: ..." or
        "SamplingParams.field must be ...") as a 400 naming the field."""
        message = str(exc)
        match = (re.match(r"SamplingParams\.(\w+)", message)
                 or re.match(r"(\w+): ", message))
        return cls.bad_request(message, match.group(1) if match else None)

    @classmethod
    def from_validation_error(cls, exc: ValidationError) -> APIError:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        param = loc[0] if loc else None
        if error["type"] == "missing":
            message = f"{'.'.join(loc)}: this field is required"
        elif error["type"] == "extra_forbidden":
            message = f"{'.'.join(loc)}: unknown field"
        else:
            where = ".".join(p for p in loc if not _is_union_tag(p))
            message = f"{where}: {error['msg']}, got {_short(error.get('input'))}"
        return cls.bad_request(message, param, code="invalid_type"
                               if error["type"].endswith("_type") else None)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


def _is_union_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or "[" in part or part.startswith("function-")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_body(raw: bytes, model: type[M]) -> M:
    """A request body as ``model``, or an ``APIError`` 400. The parser (pydantic-core's) does
    linear work on any input and refuses nesting deeper than 201 levels and integers longer
    than 4300 digits, so no body reaches a recursion limit or a quadratic conversion."""
    try:
        data = from_json(raw, allow_inf_nan=True)  # NaN reaches SamplingParams, which names it
    except ValueError as exc:
        raise APIError.bad_request(f"the body is not valid JSON: {exc}",
                                   code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError.bad_request("the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIError.from_validation_error(exc) from None


class _Request(BaseModel):
    # Strict JSON types; fields the server does not know (user, metadata, ...) are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """The sampling fields shared by completions and chat (vLLM's extensions included). Those
    named like a ``SamplingParams`` field go to it when set; it has the defaults."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias
    min_tokens: int | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's
    structured_outputs: dict[str, Any] | None = None  # vLLM's

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options is only allowed with stream=true",
                                       "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def structured_param(self) -> str:
        """The field that constrains the output (named in errors)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` (vLLM's fields) or ``response_format`` (OpenAI's) as
        StructuredOutputsParams; None for free text."""
        fields = self.structured_outputs
        fmt = self.response_format
        if fields is not None and fmt is not None and fmt.get("type") != "text":
            raise APIError.bad_request("give response_format or structured_outputs, not both",
                                       "structured_outputs")
        if fields is not None:
            unknown = sorted(set(fields) - set(STRUCTURED_KINDS))
            if unknown:
                raise APIError.bad_request(f"structured_outputs.{unknown[0]}: unknown field "
                                           f"(known: {', '.join(STRUCTURED_KINDS)})",
                                           "structured_outputs")
            return _structured({k: v for k, v in fields.items() if v is not None},
                               "structured_outputs")
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return _structured({"json_object": True}, "response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError.bad_request(
                    "response_format.json_schema must be an object with a name and a schema "
                    f"(a JSON schema object), got {_short(spec)}", "response_format")
            return _structured({"json": spec.get("schema") or {"type": "object"}},
                               "response_format")
        raise APIError.bad_request(
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\", got "
            f"{_short(kind)}", "response_format")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        given = {name: value for name in _PASSED_TO_SAMPLING_PARAMS
                 if (value := getattr(self, name)) is not None}
        structured = self.structured_outputs_params()
        if structured is not None:
            given["structured_outputs"] = structured
        if self.logit_bias:
            given["logit_bias"] = self._logit_bias()
        return sampling_params({**given, "max_tokens": max_tokens, "logprobs": logprobs})

    def _logit_bias(self) -> dict[int, float]:
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            bad = next(t for t in self.logit_bias if not t.strip().lstrip("-").isdigit())
            raise APIError.bad_request(f"logit_bias: keys must be token ids, got {bad!r}",
                                       "logit_bias") from None


def _structured(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param) from None


# (max_tokens and logprobs mean something else per endpoint: the handlers work them out.)
_PASSED_TO_SAMPLING_PARAMS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                                   if f.name in _SamplingFields.model_fields
                                   and f.name != "structured_outputs")


def sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**fields)`` (the fields a client set; the rest take its defaults), with
    the server's limit on ``n``; a bad value is a 400 naming the field."""
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise APIError.from_value_error(exc) from None
    if params.n > MAX_N:
        raise APIError.bad_request(f"n must be in [1, {MAX_N}], got {params.n}", "n")
    return params


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise APIError.bad_request("suffix is not supported", "suffix",
                                       "unsupported_parameter")
        if self.best_of is not None and self.best_of != (
                SamplingParams.n if self.n is None else self.n):
            raise APIError.bad_request("best_of other than n is not supported", "best_of",
                                       "unsupported_parameter")
        if self.echo and self.logprobs is not None:
            raise APIError.bad_request("echo with logprobs (prompt logprobs) is not supported",
                                       "echo", "unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]  # one prompt of token ids
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError.bad_request(f"at most {MAX_PROMPTS} prompts per request, got "
                                       f"{len(prompts)}", "prompt")
        return prompts


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (the content as text)."""
        optional = {"name": self.name, "tool_calls": self.tool_calls,
                    "tool_call_id": self.tool_call_id}
        return {"role": self.role, "content": self.text(),
                **{key: value for key, value in optional.items() if value}}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # OpenAI's {"type": "function", "function"}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs=true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat
    template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError.bad_request("give either prompt or messages", "prompt")


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# Response models: what the OpenAPI document promises (the tests hold the responses to them)

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error status (OpenAI's error object)."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token id or string that ended the choice


class CompletionResponse(BaseModel):
    """POST /v1/completions without streaming. With ``stream``: server-sent events, each
    ``data: `` and one such object without ``usage`` (with ``stream_options.include_usage``:
    ``usage`` null, then a last object with no choices and the usage), then ``data: [DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallModel(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallModel] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions without streaming. With ``stream``: server-sent events of
    ``chat.completion.chunk`` objects, whose choices carry a ``delta`` (the role first, then
    the new content) instead of a ``message``, then ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # the model's name, or an adapter's path
    parent: str | None = None  # a LoRA adapter's base model; None for the base


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


# ---------------------------------------------------------------------------------------------
# Responses (plain dicts: they go straight to JSON)

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outputs: list[RequestOutput]) -> dict[str, Any]:
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs),
                 sum(o.num_cached_tokens for o in outputs))


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float]],
                        token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({token_text(t): lp for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]],
                  token_text: TokenText, num_top: int) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(token_id)
        top = sorted(((t, lp) for t, lp in entry.items()), key=lambda x: -x[1])[:num_top]
        content.append({
            "token": text, "logprob": entry.get(token_id), "bytes": token_text.bytes(token_id),
            "top_logprobs": [{"token": token_text(t), "logprob": lp,
                              "bytes": token_text.bytes(t)} for t, lp in top]})
    return {"content": content}


def finish_fields(output: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": output.finish_reason, "stop_reason": output.stop_reason}


def completion_response(request_id: str, model: str, created: int,
                        choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_response(request_id: str, model: str, created: int, choices: list[dict[str, Any]],
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def now() -> int:
    return int(time.time())
