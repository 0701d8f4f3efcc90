"""The HTTP API against its own OpenAPI document: schemathesis generates requests from the
document (valid and invalid bodies) and checks every answer against it, in-process (ASGI) over
the engine fakes; plus what the document must say, and hostile bodies sent by hand."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from engine_fakes import CharTokenizer, FakeSlotAllocator, KVFakeRunner, fake_info  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance, negative_data_rejection, response_schema_conformance,
    status_code_conformance,
)

from orca_ext.async_engine import AsyncEngine  # noqa: E402
from orca_ext.engine import Engine  # noqa: E402
from orca_ext.scheduler import SchedulerConfig, make_scheduler  # noqa: E402
from orca_ext.server.http import create_app  # noqa: E402
from orca_ext.server.protocol import (  # noqa: E402
    ChatCompletionResponse, CompletionResponse, ErrorResponse,
)

MODEL = "fake"
MAX_MODEL_LEN = 128
BODY_LIMIT = 64 << 10
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
# One line (the fake tokenizer has printable ASCII only).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def app():
    allocator = FakeSlotAllocator(512, 4)
    tokenizer = CharTokenizer()
    engine = AsyncEngine(Engine(KVFakeRunner(allocator, tokenizer.vocab),
                                make_scheduler(SchedulerConfig(max_batch_size=16), allocator),
                                fake_info(MAX_MODEL_LEN, tokenizer.vocab, tokenizer)))
    yield create_app(engine, model_name=MODEL, max_body_bytes=BODY_LIMIT,
                     chat_template=CHAT_TEMPLATE)
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", CMPL),
              ("POST", CHAT), ("POST", "/tokenize"), ("POST", "/detokenize")]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def test_every_operation_is_fuzzed(app):
    assert sorted((method.upper(), path) for path, item in app.openapi()["paths"].items()
                  for method in item) == sorted(OPERATIONS)


@pytest.mark.parametrize("method, path, mode, examples", [
    *[(method, path, GenerationMode.POSITIVE, 3) for method, path in OPERATIONS[:3]],
    *[(method, path, mode, 100) for method, path in OPERATIONS[3:]
      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)],
])
def test_answers_match_the_openapi_document(api_schema, method, path, mode, examples):
    """Generated requests (``NEGATIVE``: bodies the document forbids, which must be refused
    with a 4xx) get documented statuses, content types and bodies, and never a 5xx."""
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    @given(case=api_schema[path][method].as_strategy(mode))
    def check(case):
        case.call_and_validate(checks=checks)

    check()


async def post(app, path: str, content: bytes, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, content=content,
                                 headers={"content-type": "application/json", **headers})


def test_document_describes_bodies_streams_and_errors(app):
    document = app.openapi()
    schemas = document["components"]["schemas"]
    for path, request_model in ((CMPL, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request_model}"}
        responses = operation["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "413", "429", "503"):
            error = responses[status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert {"prompt", "max_tokens", "temperature", "n", "stream"} <= set(
        schemas["CompletionRequest"]["properties"])
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas  # bad bodies are 400s, not FastAPI's 422


def test_responses_and_stream_chunks_fit_the_models(app):
    async def main():
        completion = await post(app, CMPL, json.dumps({
            "prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "logprobs": 2}).encode())
        chat = await post(app, CHAT, json.dumps({
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1}).encode())
        stream = await post(app, CMPL, json.dumps({
            "prompt": "ab", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}).encode())
        return completion, chat, stream

    completion, chat, stream = asyncio.run(main())
    assert len(CompletionResponse.model_validate(completion.json()).choices) == 4
    assert ChatCompletionResponse.model_validate(chat.json()).usage.completion_tokens == 3
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = [line for line in stream.text.splitlines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def deep(levels: int, opener: bytes = b'{"a":', closer: bytes = b"}") -> bytes:
    return opener * levels + b"1" + closer * levels


# Bodies no well-behaved client sends: each must be a 400 with the error body, quickly.
HOSTILE = [
    ("5000 levels of objects", deep(5000)),
    ("5000 levels of arrays", b'{"prompt": ' + deep(5000, b"[", b"]") + b"}"),
    ("deep inside an ignored field", b'{"prompt": "hi", "user": ' + deep(300) + b"}"),
    ("a 10,000-digit integer", b'{"prompt": "hi", "max_tokens": ' + b"9" * 10_000 + b"}"),
    ("an infinite float", b'{"prompt": "hi", "temperature": 1e400}'),
    ("a lone surrogate", b'{"prompt": "\\ud800"}'),
    ("NUL and controls in the prompt", b'{"prompt": "a\\u0000\\u001b[2J"}'),
    ("a huge negative number", b'{"prompt": "hi", "top_k": -99999999999999999999}'),
    ("a million empty prompts", b'{"prompt": [' + b"[]," * 20_000 + b"[]]}"),
    ("a duplicated key, bad the second time", b'{"prompt": "hi", "n": 1, "n": "2"}'),
    ("trailing garbage", b'{"prompt": "hi"} {"prompt": "hi"}'),
    ("a byte-order mark", b'\xef\xbb\xbf{"prompt": "hi"}'),
]


@pytest.mark.parametrize("body", [b for _, b in HOSTILE], ids=[name for name, _ in HOSTILE])
def test_hostile_bodies_are_400_with_the_error_body(app, body):
    assert len(body) <= BODY_LIMIT
    started = time.perf_counter()
    response = asyncio.run(post(app, CMPL, body))
    elapsed = time.perf_counter() - started
    assert response.status_code == 400, response.text
    ErrorResponse.model_validate(response.json())
    assert elapsed < 2.0


def test_nesting_within_the_limit_and_unknown_fields_are_accepted(app):
    body = (b'{"prompt": "hi", "max_tokens": 2, "user": ' + deep(150)
            + b', "metadata": {"x": [1, {"y": null}]}, "unknown": true}')
    response = asyncio.run(post(app, CMPL, body))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_body_over_the_limit_is_still_413(app):
    body = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    response = asyncio.run(post(app, CMPL, body))
    assert response.status_code == 413
    assert ErrorResponse.model_validate(response.json()).error.code == "request_too_large"
