"""The OpenAI-compatible HTTP API of a real ``orca-serve`` (built-in model), called with the
real ``openai`` client and with plain HTTP (curl's view: SSE lines, /metrics, /health)."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("grpc")

from server_helpers import server  # noqa: E402,F401  (the shared server fixture)

MODEL = "orca-tiny"


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60,
                       max_retries=0) as c:
        yield c


def test_models_and_health(server, client):  # noqa: F811
    assert [m.id for m in client.models.list().data] == [MODEL]
    with server.client() as http:
        assert http.get("/health").json() == {"status": "ok"}


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="Hello, Orca", max_tokens=7,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.prompt_tokens == len("Hello, Orca".encode())  # byte-level tokenizer
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_completion_greedy_is_deterministic_and_matches_streaming(client):
    kwargs = dict(model=MODEL, prompt=[72, 105, 33], max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == a.choices[0].text


def test_completion_batch_n_logprobs_seed_echo(client):
    out = client.completions.create(model=MODEL, prompt=["ab", "xyz"], n=2, max_tokens=3,
                                    logprobs=2, seed=7, echo=False,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 2 + 3
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
        assert all(v <= 0 for v in lp.token_logprobs)
    again = client.completions.create(model=MODEL, prompt="ab", n=2, max_tokens=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices[:2]]
    echoed = client.completions.create(model=MODEL, prompt="echo me", max_tokens=2, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text.startswith("echo me")


def test_completion_stop_string(client):
    # A seeded sample is fixed: stop at a character it produces (not its first).
    base = dict(model=MODEL, prompt="stop test", max_tokens=32, seed=3,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = next((full[i] for i in range(1, len(full))
                 if full[i].isascii() and full[i] not in full[:i]), None)
    if stop is None:
        pytest.skip("the greedy text has no usable stop character")
    out = client.completions.create(stop=[stop], **base).choices[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]


def test_completion_streaming_with_usage(client):
    stream = client.completions.create(model=MODEL, prompt="stream", max_tokens=9, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == "length" and not any(finishes[:-1])


def test_chat(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi!"}],
        max_tokens=5, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    (choice,) = out.choices
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5
    # The servers' --chat-template: "role: content\n" per message, then "assistant:".
    assert out.usage.prompt_tokens == len("system: Be brief.\nuser: Hi!\nassistant:")
    content = choice.logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)


def test_chat_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Yo"}]}],
        max_completion_tokens=6, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 12
    finished = {c.choices[0].index: c.choices[0].finish_reason
                for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_sse_wire_format(server):  # noqa: F811
    body = {"model": MODEL, "prompt": "curl", "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    tokens = 0
    for e in events[:-1]:
        chunk = json.loads(e[len("data: "):])
        assert chunk["object"] == "text_completion"
        tokens += 1
    assert tokens >= 1


def test_metrics(server, client):  # noqa: F811
    client.completions.create(model=MODEL, prompt="m", max_tokens=2,
                              extra_body={"ignore_eos": True})
    m = server.metrics()
    for name in ("orca_num_requests_waiting", "orca_num_requests_running",
                 "orca_kv_cache_usage_ratio", "orca_kv_cache_total_blocks",
                 "orca_time_to_first_token_seconds_count",
                 "orca_time_per_output_token_seconds_count",
                 "orca_e2e_request_latency_seconds_count", "orca_generation_tokens_total",
                 "orca_prompt_tokens_total", 'orca_requests_total{api="completions"}'):
        assert name in m, name
    assert m["orca_kv_cache_total_blocks"] == 4096 / 16
    assert m["orca_e2e_request_latency_seconds_count"] >= 1
    assert m['orca_requests_finished_total{finish_reason="length"}'] >= 1


def test_disconnect_aborts_a_non_streaming_request(server):  # noqa: F811
    import httpx

    before = server.wait_idle()
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 1000, "ignore_eos": True}
    with server.client(timeout=httpx.Timeout(60, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            http.post("/v1/completions", json=body)
    after = server.wait_idle()
    key = 'orca_requests_finished_total{finish_reason="abort"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after["orca_generation_tokens_total"] - before["orca_generation_tokens_total"] < 1000
