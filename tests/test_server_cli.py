"""``orca-serve``'s options as vLLM names them (--max-model-len, --max-num-seqs, --seed,
--disable-log-requests), its grouped --help, and the request log: the CLI's engine and serving
core built in-process and called through the HTTP app."""
from __future__ import annotations

import asyncio
import logging

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from orca_ext.distributed import ParallelConfig  # noqa: E402
from orca_ext.server.__main__ import build_core, build_parser  # noqa: E402
from orca_ext.server.http import create_app  # noqa: E402

BASE = ["--model", "orca-tiny", "--device", "cpu", "--dtype", "float32",
        "--kv-cache-tokens", "2048"]


def build(*args: str):
    core, banner = build_core(build_parser().parse_args([*BASE, *args]), ParallelConfig())
    return core


@pytest.fixture
def cores():
    built = []

    def make(*args: str):
        built.append(build(*args))
        return built[-1]

    yield make
    for core in built:
        core.engine.shutdown()


def complete(core, **body) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(main())


def test_max_model_len_caps_the_context_with_the_usual_error(cores):
    capped, default = cores("--max-model-len", "64"), cores()
    assert (capped.max_model_len, default.max_model_len) == (64, 1024)
    assert capped.engine.engine.info.max_model_len == 64
    over_cap = complete(capped, prompt="x" * 65)
    over_model = complete(default, prompt="x" * 1025)
    for response, limit, length in ((over_cap, 64, 65), (over_model, 1024, 1025)):
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        assert error["message"] == (f"This model's maximum context length is {limit} tokens, "
                                    f"but the prompt has {length} tokens")
    fits = complete(capped, prompt="x" * 60, max_tokens=4, ignore_eos=True)
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 4
    too_long = complete(capped, prompt="x" * 60, max_tokens=5)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    # The default KV size follows the capped context: max-num-seqs contexts of 64 tokens.
    default_kv = build_core(build_parser().parse_args(
        ["--model", "orca-tiny", "--device", "cpu", "--max-num-seqs", "2", "--max-model-len",
         "64"]), ParallelConfig())[0]
    try:
        allocator = default_kv.engine.engine.scheduler.allocator
        assert allocator.num_blocks * allocator.block_size == 2 * 64
    finally:
        default_kv.engine.shutdown()


def test_max_model_len_longer_than_the_model_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len 4096 is longer than the model's "
                                         r"context \(1024 tokens\)"):
        build("--max-model-len", "4096")


def test_max_num_seqs_is_max_batch_size(cores):
    assert build_parser().parse_args(["--max-batch-size", "5"]).max_batch_size == 5
    core = cores("--max-num-seqs", "3")
    assert core.engine.engine.scheduler.config.max_batch_size == 3


def test_seed_sets_the_draws_of_unseeded_requests(cores):
    def first_sample(seed: str) -> str:
        response = complete(cores("--seed", seed), prompt="Once", max_tokens=12,
                            temperature=1.0, ignore_eos=True)
        return response.json()["choices"][0]["text"]

    one = first_sample("1")
    assert first_sample("1") == one
    assert first_sample("2") != one


def test_requests_are_logged_unless_disabled(cores, caplog):
    caplog.set_level(logging.INFO, logger="orca_ext.server.requests")
    logged, quiet = cores(), cores("--disable-log-requests")
    response = complete(logged, prompt="abc", max_tokens=3, n=2, ignore_eos=True)
    complete(quiet, prompt="abc", max_tokens=3, ignore_eos=True)
    (record,) = caplog.records
    fields = record.request
    assert fields["request_id"] == response.json()["id"]
    assert (fields["prompt_tokens"], fields["output_tokens"]) == (3, 6)
    assert fields["finish_reason"] == "length,length"
    assert 0 <= fields["ttft_s"] <= fields["total_s"]
    assert record.getMessage().startswith(f"request_id={fields['request_id']} prompt_tokens=3 "
                                          "output_tokens=6 ttft_s=")


def test_help_groups_the_options():
    text = build_parser().format_help()
    titles = ["model:", "scheduling:", "KV cache:", "server:", "security:", "distributed"]
    positions = [text.index(f"\n{title}") for title in titles]
    assert positions == sorted(positions)
    for option in ("--max-model-len", "--max-num-seqs", "--seed", "--disable-log-requests"):
        assert option in text
