"""A bounded load test on a real ``orca-serve``: 200 requests from 32 concurrent clients over
both APIs (streaming and not), 10% of them disconnecting mid-stream. Every surviving request
gets exactly the tokens it asked for, the disconnected ones are aborted, and the KV pool ends
fully free. Marked slow (deselect with -m "not slow"); it runs in CI in well under a minute."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("grpc")

from server_helpers import server  # noqa: E402,F401  (the shared server fixture)

MODEL = "orca-tiny"
NUM_REQUESTS, CONCURRENCY = 200, 32


async def disconnecting(client, i):
    body = {"model": MODEL, "prompt": f"leave {i}", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                return "left"  # closing the response mid-stream drops the connection
    raise AssertionError("the stream ended before the client left")


async def surviving(client, i):
    max_tokens = 2 + i % 7
    chat = i % 4 >= 2
    stream = i % 2 == 0
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.7, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}"}]
    else:
        body["prompt"] = f"request {i}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "length"
        return out["usage"]["completion_tokens"], max_tokens
    body.update(stream=True, stream_options={"include_usage": True})
    usage, finish = None, None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    finish = choice.get("finish_reason") or finish
            elif line:
                assert line == "data: [DONE]"
    assert finish == "length"
    return usage["completion_tokens"], max_tokens


@pytest.mark.slow
def test_load_with_disconnects(server):  # noqa: F811
    before = server.wait_idle()
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(client, i):
        async with limit:
            return await (disconnecting(client, i) if i % 10 == 0 else surviving(client, i))

    async def main():
        limits = httpx.Limits(max_connections=CONCURRENCY + 8)
        async with server.async_client(limits=limits) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS))), 150)

    start = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - start
    left = [r for r in results if r == "left"]
    done = [r for r in results if r != "left"]
    assert len(left) == NUM_REQUESTS // 10 and len(done) == NUM_REQUESTS - len(left)
    assert all(got == asked for got, asked in done), [r for r in done if r[0] != r[1]]

    after = server.wait_idle()  # no request left, every KV block free again
    assert after["orca_kv_cache_used_blocks"] == 0
    assert after["orca_kv_cache_total_blocks"] == before["orca_kv_cache_total_blocks"]

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('orca_requests_finished_total{finish_reason="abort"}') == len(left)
    assert delta('orca_requests_finished_total{finish_reason="length"}') == len(done)
    print(f"{NUM_REQUESTS} requests in {elapsed:.1f} s")
