"""The gRPC API of a real ``orca-serve``: Generate, GenerateStream, status codes, cancellation;
and the committed stubs match orca.proto."""
from __future__ import annotations

from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("fastapi")

from server_helpers import server  # noqa: E402,F401  (the shared server fixture)

from orca_ext.server import orca_pb2, orca_pb2_grpc  # noqa: E402

Params = orca_pb2.SamplingParameters
SERVER_DIR = Path(__file__).resolve().parents[1] / "orca_ext" / "server"


@pytest.fixture(scope="module")
def stub(server):  # noqa: F811
    with grpc.insecure_channel(server.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield orca_pb2_grpc.OrcaStub(channel)


def req(text="gRPC", **params):
    return orca_pb2.GenerateRequest(text=text, params=Params(**params))


def test_health(stub):
    r = stub.Health(orca_pb2.HealthRequest(), timeout=10)
    assert r.healthy and r.model == "orca-tiny"


def test_generate(stub):
    r = stub.Generate(req(max_tokens=5, ignore_eos=True, n=2, logprobs=1, seed=1), timeout=60)
    assert r.finished and r.model == "orca-tiny" and r.request_id
    assert [c.index for c in r.completions] == [0, 1]
    for c in r.completions:
        assert len(c.token_ids) == 5 and c.finish_reason == "length"
        assert len(c.logprobs) == 5 and c.HasField("cumulative_logprob")
        assert all(lp.sampled.token_id == t for lp, t in zip(c.logprobs, c.token_ids))
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 10
    assert r.usage.total_tokens == 14


def test_usage_reports_cached_prompt_tokens(stub):
    """The second request for a 40-token prompt reuses its first two 16-token blocks."""
    prompt = orca_pb2.TokenIds(ids=[(7 * i + 5) % 200 + 1 for i in range(40)])
    request = orca_pb2.GenerateRequest(token_ids=prompt, params=Params(max_tokens=2))
    first = stub.Generate(request, timeout=60)
    second = stub.Generate(request, timeout=60)
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 32
    streamed = list(stub.GenerateStream(request, timeout=60))
    assert streamed[-1].usage.cached_tokens == 32


def test_stream_matches_unary(stub):
    request = orca_pb2.GenerateRequest(token_ids=orca_pb2.TokenIds(ids=[1, 2, 3]),
                                       params=Params(max_tokens=7, temperature=0,
                                                     ignore_eos=True))
    unary = stub.Generate(request, timeout=60).completions[0]
    messages = list(stub.GenerateStream(request, timeout=60))
    assert messages[-1].finished and not any(m.finished for m in messages[:-1])
    assert messages[-1].usage.completion_tokens == 7
    ids = [t for m in messages for c in m.completions for t in c.token_ids]
    text = "".join(c.text for m in messages for c in m.completions)
    assert ids == list(unary.token_ids) and text == unary.text
    assert messages[-1].completions[-1].finish_reason == "length"


@pytest.mark.parametrize("request_, code", [
    (req(top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT),
    (req(n=0), grpc.StatusCode.INVALID_ARGUMENT),
    (req(max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT),
    (req(text="x" * 2000), grpc.StatusCode.INVALID_ARGUMENT),
    (req(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    (orca_pb2.GenerateRequest(params=Params(max_tokens=2)), grpc.StatusCode.INVALID_ARGUMENT),
    (orca_pb2.GenerateRequest(token_ids=orca_pb2.TokenIds(ids=[100000])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (orca_pb2.GenerateRequest(text="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND),
    (req(text="x" * (1 << 20 | 1)), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over 1 MiB
])
def test_errors(stub, request_, code):
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as info:
            call(request_, timeout=30)
        assert info.value.code() == code, info.value.details()
        assert info.value.details()


def test_duplicate_request_id_and_cancel(server, stub):  # noqa: F811
    before = server.metrics()
    request = orca_pb2.GenerateRequest(request_id="dup", text="long",
                                       params=Params(max_tokens=500, ignore_eos=True))
    call = stub.GenerateStream(request, timeout=60)
    first = next(call)
    assert first.request_id == "dup"
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(orca_pb2.GenerateRequest(request_id="dup", text="x"), timeout=30)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert server.metrics()["orca_kv_cache_used_blocks"] > 0
    call.cancel()
    after = server.wait_idle()
    key = 'orca_requests_finished_total{finish_reason="abort"}'
    assert after.get(key, 0) == before.get(key, 0) + 1


def test_committed_stubs_match_the_proto(tmp_path):
    tools = pytest.importorskip("grpc_tools")
    from importlib.metadata import version

    from grpc_tools import protoc

    from orca_ext.server.grpc_server import GRPC_TOOLS_VERSION
    if version("grpcio-tools") != GRPC_TOOLS_VERSION:
        pytest.skip(f"stubs are generated with grpcio-tools=={GRPC_TOOLS_VERSION}")
    root = SERVER_DIR.parents[1]
    include = Path(tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{root}", f"-I{include}", f"--python_out={tmp_path}",
                      f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                      str(SERVER_DIR / "orca.proto")])
    assert rc == 0
    for name in ("orca_pb2.py", "orca_pb2.pyi", "orca_pb2_grpc.py"):
        generated = (tmp_path / "orca_ext" / "server" / name).read_text()
        assert generated == (SERVER_DIR / name).read_text(), f"{name} is stale: regenerate it"
