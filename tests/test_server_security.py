"""HTTPS and gRPC over TLS with a self-signed certificate made here, the API key, and the
waiting-queue bound (429 / RESOURCE_EXHAUSTED), on a real ``orca-serve``."""
from __future__ import annotations

import asyncio
import json
import ssl
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")
pytest.importorskip("cryptography")
pytest.importorskip("fastapi")

from server_helpers import PLAIN_CHAT_TEMPLATE, ServerProcess, make_self_signed_cert  # noqa: E402

from orca_ext.server import orca_pb2, orca_pb2_grpc  # noqa: E402

KEY = "s3cret-key"
MODEL = "orca-tiny"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    cert, key = make_self_signed_cert(tmp_path_factory.mktemp("tls"))
    return cert, key, ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def secure_server(tls):
    cert, key, context = tls
    srv = ServerProcess("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--api-key", KEY,
                        "--grpc-port", "0", "--max-batch-size", "1", "--max-queue", "1",
                        "--chat-template", PLAIN_CHAT_TEMPLATE, verify=context, api_key=KEY)
    srv.start()
    yield srv
    assert srv.stop() == 0  # a clean shutdown on SIGTERM


@pytest.fixture(scope="module")
def grpc_stub(secure_server, tls):
    credentials = grpc.ssl_channel_credentials(root_certificates=tls[0].read_bytes())
    with grpc.secure_channel(secure_server.grpc_target, credentials) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield orca_pb2_grpc.OrcaStub(channel)


def openai_client(server, key):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                         timeout=60, http_client=httpx.Client(verify=server.verify))


def test_https_with_api_key(secure_server):
    assert secure_server.base_url.startswith("https://127.0.0.1:")
    with openai_client(secure_server, KEY) as client:
        out = client.completions.create(model=MODEL, prompt="tls", max_tokens=3,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"


def test_missing_or_wrong_api_key_is_401(secure_server):
    with openai_client(secure_server, "wrong") as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert info.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with secure_server.client() as http:  # no key at all
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = http.post("/v1/completions", json={"prompt": "x"},
                      headers={"Authorization": f"Basic {KEY}"})
        assert r.status_code == 401
        r = http.post("/v1/chat/completions", content=b"{broken")  # 401 before parsing
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200  # probes need no key
        assert http.get("/metrics").status_code == 200


def test_plain_http_client_cannot_talk_to_the_https_port(secure_server):
    plain = secure_server.base_url.replace("https://", "http://")
    with httpx.Client(timeout=10) as http:
        try:
            r = http.get(f"{plain}/health")
        except httpx.HTTPError:
            return
        assert r.status_code == 400  # uvicorn answers plain HTTP on a TLS port with 400


def test_grpc_over_tls_with_api_key(grpc_stub):
    request = orca_pb2.GenerateRequest(
        text="tls", params=orca_pb2.SamplingParameters(max_tokens=3, ignore_eos=True))
    r = grpc_stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {KEY}")])
    assert r.usage.completion_tokens == 3
    for metadata in ([], [("authorization", "Bearer nope")]):
        for call in (grpc_stub.Generate,
                     lambda *a, **k: list(grpc_stub.GenerateStream(*a, **k))):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_full_queue_is_refused(secure_server, grpc_stub):
    """One running request (max batch size 1), one waiting (max queue 1): the next is 429."""
    auth = secure_server.headers()

    async def main():
        async with secure_server.async_client(headers=auth) as client:
            long_body = {"model": MODEL, "prompt": "long", "max_tokens": 1000,
                         "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=long_body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                waiting = asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "queued", "max_tokens": 2, "ignore_eos": True}))
                deadline = time.monotonic() + 30
                while (await asyncio.to_thread(secure_server.metrics)
                       )["orca_num_requests_waiting"] != 1:
                    assert time.monotonic() < deadline and not waiting.done()
                    await asyncio.sleep(0.05)
                refused = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "refused", "max_tokens": 2})
                with pytest.raises(grpc.RpcError) as info:
                    await asyncio.to_thread(
                        grpc_stub.Generate, orca_pb2.GenerateRequest(text="refused"),
                        timeout=30, metadata=[("authorization", f"Bearer {KEY}")])
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Leaving the stream disconnects: the long request is aborted, the queued one runs.
            done = await asyncio.wait_for(waiting, 60)
            return refused, done

    refused, done = asyncio.run(main())
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    m = secure_server.wait_idle()
    assert m['orca_requests_finished_total{finish_reason="abort"}'] >= 1
    assert json.dumps(m)  # metrics parse
