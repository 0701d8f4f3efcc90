"""Bad input: every malformed request gets a 4xx with an OpenAI-style error body, while good
requests sent at the same time complete, and no KV block leaks."""
from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("grpc")

from server_helpers import server  # noqa: E402,F401  (the shared server fixture)

MODEL = "orca-tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def ok(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


# (method, path, body: dict -> JSON, bytes -> raw, status, param or None)
BAD = [
    ("POST", CMPL, b'{"prompt": "hi",', 400, None),  # malformed JSON
    ("POST", CMPL, b"[1, 2]", 400, None),  # not an object
    ("POST", CMPL, b"", 400, None),  # empty body
    ("POST", CMPL, b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8
    ("POST", CMPL, b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, None),  # nested 5000 levels
    ("POST", CMPL, {"model": MODEL}, 400, "prompt"),  # missing prompt
    ("POST", CMPL, {"prompt": 5}, 400, "prompt"),
    ("POST", CMPL, {"prompt": ""}, 400, "prompt"),
    ("POST", CMPL, {"prompt": []}, 400, "prompt"),
    ("POST", CMPL, {"prompt": [1, "a"]}, 400, "prompt"),
    ("POST", CMPL, {"prompt": [999999]}, 400, "prompt"),  # outside the vocabulary
    ("POST", CMPL, {"prompt": [-1]}, 400, "prompt"),
    ("POST", CMPL, {"prompt": "x" * 2000}, 400, "prompt"),  # longer than the context (1024)
    ("POST", CMPL, ok(max_tokens=1023), 400, "max_tokens"),  # prompt + max_tokens > context
    ("POST", CMPL, ok(max_tokens="5"), 400, "max_tokens"),
    ("POST", CMPL, ok(max_tokens=0), 400, "max_tokens"),
    ("POST", CMPL, ok(max_tokens=-3), 400, "max_tokens"),
    ("POST", CMPL, ok(max_tokens=2.5), 400, "max_tokens"),
    ("POST", CMPL, ok(temperature=-1), 400, "temperature"),
    ("POST", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("POST", CMPL, ok(top_p=1.5), 400, "top_p"),
    ("POST", CMPL, ok(top_k=-5), 400, "top_k"),
    ("POST", CMPL, ok(min_p=2), 400, "min_p"),
    ("POST", CMPL, ok(presence_penalty=5), 400, "presence_penalty"),
    ("POST", CMPL, ok(frequency_penalty=-3), 400, "frequency_penalty"),
    ("POST", CMPL, ok(repetition_penalty=0), 400, "repetition_penalty"),
    ("POST", CMPL, ok(n=0), 400, "n"),
    ("POST", CMPL, ok(n=10_000), 400, "n"),
    ("POST", CMPL, ok(logprobs=50), 400, "logprobs"),
    ("POST", CMPL, ok(stop=[""]), 400, "stop"),
    ("POST", CMPL, ok(stop=5), 400, "stop"),
    ("POST", CMPL, ok(seed="abc"), 400, "seed"),
    ("POST", CMPL, ok(seed=2 ** 70), 400, "seed"),  # would fail the engine step
    ("POST", CMPL, ok(ignore_eos="yes"), 400, "ignore_eos"),
    ("POST", CMPL, ok(stream="true"), 400, "stream"),
    ("POST", CMPL, ok(stream_options={"include_usage": True}), 400, "stream_options"),
    ("POST", CMPL, ok(logit_bias={"abc": 5}), 400, "logit_bias"),
    ("POST", CMPL, ok(logit_bias={"1": 500}), 400, "logit_bias"),
    ("POST", CMPL, ok(logit_bias={"999999": 1}), 400, "logit_bias"),  # outside the vocabulary
    ("POST", CMPL, ok(min_tokens=5), 400, "min_tokens"),  # more than max_tokens
    ("POST", CMPL, ok(structured_outputs={"json": {"type": "frob"}}), 400, "structured_outputs"),
    ("POST", CMPL, ok(structured_outputs={"regex": "(a"}), 400, "structured_outputs"),
    ("POST", CMPL, ok(structured_outputs={"grammar": "start: foo"}), 400, "structured_outputs"),
    ("POST", CMPL, ok(structured_outputs={"grammar": "root ::= foo"}), 400,
     "structured_outputs"),
    ("POST", CMPL, ok(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
     "structured_outputs"),
    ("POST", CMPL, ok(structured_outputs={"choice": []}), 400, "structured_outputs"),
    ("POST", CMPL, ok(structured_outputs={"xml": "a"}), 400, "structured_outputs"),
    ("POST", CMPL, ok(response_format={"type": "xml"}), 400, "response_format"),
    ("POST", CMPL, ok(model="gpt-9"), 404, "model"),  # unknown model (vLLM: 404)
    ("POST", CMPL, {"prompt": "x" * (1 << 20 | 1)}, 413, None),  # body over 1 MiB
    ("POST", CHAT, {"model": MODEL}, 400, "messages"),
    ("POST", CHAT, {"messages": []}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("POST", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("POST", CHAT, {"messages": MSGS, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    ("POST", CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools"),
    ("POST", CHAT, {"messages": MSGS, "tools": [TOOL, TOOL]}, 400, "tools"),
    ("POST", CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "frob"}}}], "tool_choice": "required"}, 400, "tools"),
    ("POST", CHAT, {"messages": MSGS, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("POST", CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    ("POST", CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"minimum": "x"}}}}}},
     400, "response_format"),
    ("POST", CHAT, {"messages": MSGS, "response_format": {"type": "json_schema",
                                                          "json_schema": "x"}},
     400, "response_format"),
    ("POST", CHAT, {"messages": MSGS, "model": "nope"}, 404, "model"),
    ("GET", CMPL, None, 405, None),
    ("POST", "/v1/nowhere", {}, 404, None),
]


async def bad_request(client, method, path, body):
    if isinstance(body, bytes):
        return await client.request(method, path, content=body,
                                    headers={"content-type": "application/json"})
    if body is None:
        return await client.request(method, path)
    return await client.request(method, path, json=body)


async def good_stream(client, max_tokens):
    body = {"model": MODEL, "prompt": "good", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with client.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    return usage["completion_tokens"]


def test_malformed_requests_while_serving(server):  # noqa: F811
    assert len(BAD) >= 20
    before = server.metrics()

    async def main():
        async with server.async_client() as client:
            good = [asyncio.ensure_future(good_stream(client, 24)) for _ in range(6)]
            bad = await asyncio.gather(*(bad_request(client, m, p, b) for m, p, b, _, _ in BAD))
            return bad, await asyncio.wait_for(asyncio.gather(*good), 120)

    responses, good_tokens = asyncio.run(main())
    failures = []
    for (method, path, body, status, param), r in zip(BAD, responses):
        what = f"{method} {path} {str(body)[:60]}"
        if r.status_code != status:
            failures.append(f"{what}: {r.status_code} {r.text[:200]}")
            continue
        error = r.json().get("error")
        if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
                and error["message"]):
            failures.append(f"{what}: body {r.text[:200]}")
        elif param is not None and error["param"] != param:
            failures.append(f"{what}: param {error['param']!r} != {param!r} ({error})")
    assert not failures, "\n".join(failures)
    assert good_tokens == [24] * 6
    after = server.wait_idle()
    assert after["orca_kv_cache_used_blocks"] == 0
    errors = sum(v for k, v in after.items() if k.startswith("orca_request_errors_total"))
    errors -= sum(v for k, v in before.items() if k.startswith("orca_request_errors_total"))
    assert errors == len(BAD)


def test_server_survives_a_client_that_sends_garbage(server):  # noqa: F811
    import socket

    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        s.recv(1024)  # a 400 from uvicorn, or a closed connection
    with server.client() as http:
        r = http.post(CMPL, json=ok(ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
