"""Smoke tests of the serving benchmark (bench/serving.py, bench/serving_sweep.py): a handful of
small requests through the engine in-process (and through the HTTP app in-process), checking
that the report is sane."""
from __future__ import annotations

import math
import sys

import pytest

import serving
import serving_sweep

SPEC = serving.WorkloadSpec("orca", (8, 48), (1, 12), max_model_len=1024, vocab_size=257,
                            special_ids=(256,))


@pytest.fixture(scope="module")
def async_engine():
    from orca_ext.async_engine import AsyncEngine
    from orca_ext import EngineConfig, build_engine

    engine = AsyncEngine(build_engine(EngineConfig("orca-tiny", device="cpu", max_batch_size=4,
                                                   kv_cache_tokens=4 * 64)))
    yield engine
    engine.shutdown()


def check_point(point: dict, requests: list[serving.WorkloadRequest],
                records: list[serving.RequestRecord]) -> None:
    assert point["completed"] == point["num_requests"] == len(requests)
    assert point["failed"] == 0 and point["errors"] == []
    for request, record in zip(requests, records):
        assert record.num_output == request.output_len == len(record.token_times)
        assert record.finish_reason == "length"
        assert record.arrival <= record.token_times[0] <= record.finish
        assert record.token_times == sorted(record.token_times)
    assert point["num_output_tokens"] == sum(r.output_len for r in requests)
    assert point["request_throughput"] > 0 and point["output_throughput"] > 0
    for name in serving.METRICS:
        stats = point[name]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert point["ttft"]["p50"] <= point["latency"]["p50"]
    assert point["norm_latency"]["p99"] <= point["latency"]["p99"]


def test_request_stream_is_a_function_of_its_arguments() -> None:
    a = serving.make_requests(SPEC, 8, 2.0, seed=3)
    assert a == serving.make_requests(SPEC, 8, 2.0, seed=3)
    assert serving.make_requests(SPEC, 5, 2.0, seed=3) == a[:5]  # prefixes agree
    b = serving.make_requests(SPEC, 8, 4.0, seed=3)  # another rate: same requests, times halved
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(math.isclose(x.arrival, 2 * y.arrival) for x, y in zip(a, b))
    assert a[0].arrival == 0 and all(x.arrival < y.arrival for x, y in zip(a, a[1:]))
    assert all(r.arrival == 0 for r in serving.make_requests(SPEC, 4, math.inf))
    for r in a:
        assert 8 <= r.prompt_len == len(r.prompt) <= 48 and 1 <= r.output_len <= 12
        assert 256 not in r.prompt
    assert serving.make_requests(SPEC, 8, 2.0, seed=4) != a


def test_sharegpt_lengths_fit_the_context() -> None:
    spec = serving.WorkloadSpec("sharegpt", max_model_len=300, prompt_kind="text")
    requests = serving.make_requests(spec, 200, 1.0)
    assert all(r.prompt_len + r.output_len <= 300 and len(r.prompt) == r.prompt_len
               for r in requests)
    assert len({r.output_len for r in requests}) > 50  # a spread, not a constant


def test_in_process_run_reports_every_request(async_engine) -> None:
    backend = serving.InProcessBackend(async_engine)
    requests = serving.make_requests(SPEC, 6, 20.0, seed=1)
    point, records = serving.measure(backend, SPEC, 6, 20.0, seed=1)
    check_point(point, requests, records)
    assert point["rate"] == 20.0
    assert "norm_latency" in serving.format_table([{**point, "policy": "orca"}])


def test_http_backend_against_the_app(async_engine) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from orca_ext.server.http import create_app

    app = create_app(async_engine, model_name="orca-tiny")
    for prompt_kind, logprobs in (("ids", True), ("text", False)):
        spec = serving.WorkloadSpec("orca", (8, 32), (1, 6), vocab_size=256,
                                    prompt_kind=prompt_kind)
        backend = serving.HTTPBackend("http://test", logprobs=logprobs,
                                      transport=httpx.ASGITransport(app=app))
        point, records = serving.measure(backend, spec, 3, math.inf)
        check_point(point, serving.make_requests(spec, 3, math.inf), records)


def test_sustained_throughput_interpolates_the_crossing() -> None:
    def point(rate: float, throughput: float, latency: float) -> dict:
        return {"policy": "x", "rate": rate, "request_throughput": throughput,
                "norm_latency": {"p50": latency}}

    curve = [point(1, 1.0, 0.010), point(2, 2.0, 0.020), point(3, 2.5, 0.060)]
    assert serving_sweep.sustained(curve, 0.040) == (pytest.approx(2.25), False)
    assert serving_sweep.sustained(curve, 0.100) == (2.5, True)  # never crossed: a lower bound
    assert serving_sweep.sustained(curve, 0.005) == (None, False)
    dip = [point(1, 1.0, 0.010), point(2, 2.0, 0.050), point(3, 3.0, 0.020)]
    assert serving_sweep.sustained(dip, 0.030) == (pytest.approx(1.5), False)  # first crossing


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    points = [{"policy": "orca", "rate": 1.0, "request_throughput": 1.0,
               "norm_latency": {"p50": 0.01}}]
    serving_sweep.plot(points, ["orca"], 0.02, "title", [tmp_path / "sweep.png"])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("no plot: matplotlib is not installed (pip install 'orca_ext[bench]'")
    assert str(tmp_path / "sweep.png") in line and not (tmp_path / "sweep.png").exists()
