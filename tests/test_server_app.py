"""The server's pieces in-process: the app over a live and a dead engine, chat templates, the
gRPC server in the same event loop, the CLI's argument handling."""
from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")
pytest.importorskip("fastapi")

from orca_ext.async_engine import AsyncEngine  # noqa: E402
from orca_ext import EngineConfig, build_engine  # noqa: E402
from orca_ext.server import ServingCore, create_app, start_grpc_server  # noqa: E402
from orca_ext.server import orca_pb2, orca_pb2_grpc  # noqa: E402
from orca_ext.server.__main__ import main, parse_size  # noqa: E402
from orca_ext.server.protocol import APIError  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(build_engine(EngineConfig("orca-tiny", device="cpu", max_batch_size=4,
                                                   kv_cache_tokens=1024)))
    yield engine
    engine.shutdown()


async def call(app, method, path, **kwargs):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def test_custom_chat_template(engine):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
                "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}")
    app = create_app(engine, model_name="tiny", chat_template=template)

    async def main():
        good = await call(app, "POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 2,
            "ignore_eos": True})
        bad = await call(app, "POST", "/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "abc"}]})
        return good, bad

    good, bad = asyncio.run(main())
    assert good.status_code == 200, good.text
    # bos_token is orca-tiny's <|endoftext|>, one special token; then "[user]abc[assistant]"
    # byte by byte
    assert good.json()["usage"]["prompt_tokens"] == 1 + len("[user]abc[assistant]")
    assert bad.status_code == 400 and "user first" in bad.json()["error"]["message"]


def test_grpc_and_http_share_one_loop_and_core(engine):
    core = ServingCore(engine, "orca-tiny", api_key="k")
    app = create_app(core)

    async def main():
        server, port = await start_grpc_server(core, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = orca_pb2_grpc.OrcaStub(channel)
                r = await stub.Generate(
                    orca_pb2.GenerateRequest(text="hi", params=orca_pb2.SamplingParameters(
                        max_tokens=3, ignore_eos=True)),
                    metadata=[("authorization", "Bearer k")], timeout=30)
            http = await call(app, "POST", "/v1/completions", headers={"Authorization":
                                                                       "Bearer k"},
                              json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            metrics = await call(app, "GET", "/metrics")
        finally:
            await server.stop(None)
        return r, http, metrics.text

    r, http, metrics = asyncio.run(main())
    assert r.usage.completion_tokens == 3
    assert http.json()["usage"]["completion_tokens"] == 3
    assert 'orca_requests_total{api="grpc"} 1.0' in metrics
    assert 'orca_requests_total{api="completions"} 1.0' in metrics


def test_dead_engine_is_503():
    dead = AsyncEngine(build_engine(EngineConfig("orca-tiny", device="cpu", max_batch_size=1,
                                                 kv_cache_tokens=64)))
    dead.shutdown()
    app = create_app(dead)

    async def main():
        health = await call(app, "GET", "/health")
        gen = await call(app, "POST", "/v1/completions", json={"prompt": "hi"})
        server, port = await start_grpc_server(dead, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = orca_pb2_grpc.OrcaStub(channel)
                healthy = (await stub.Health(orca_pb2.HealthRequest(), timeout=10)).healthy
                try:
                    await stub.Generate(orca_pb2.GenerateRequest(text="hi"), timeout=10)
                    code = None
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
        finally:
            await server.stop(None)
        return health, gen, healthy, code

    health, gen, healthy, code = asyncio.run(main())
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    assert gen.status_code == 503 and gen.json()["error"]["type"]
    assert healthy is False and code == grpc.StatusCode.UNAVAILABLE


def test_api_error_names_the_field():
    e = APIError.from_value_error(ValueError("SamplingParams.top_p must be in (0, 1], got 2"))
    assert (e.status, e.param, e.body()["error"]["type"]) == (400, "top_p",
                                                              "invalid_request_error")
    assert APIError.from_value_error(ValueError("prompt: must not be empty")).param == "prompt"
    assert APIError(429, "busy").type == "rate_limit_error"


def test_cli(capsys, tmp_path):
    assert parse_size("1024") == 1024 and parse_size("2GiB") == 2 << 30
    assert parse_size("512M") == 512 << 20 and parse_size("1GB") == 10 ** 9
    assert main(["--ssl-certfile", "c.pem"]) == 2
    assert main(["--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--kv-cache-tokens", "10", "--kv-cache-memory", "1GiB"])
