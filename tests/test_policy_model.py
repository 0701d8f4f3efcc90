"""The policy model (bench/policy_model.py) without a model: the simulators on cases worked out
by hand, the throughput-at-a-latency-limit helper, the cost fit, and the ``--costs`` CLI path."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import policy_model as pm

UNIT = pm.Costs(1.0, 0.0, 0.0, 0.0, 0.0)  # every iteration takes 1 s


def run(policy: str, arrivals: list[float], prompts: list[int], outputs: list[int],
        costs: pm.Costs = UNIT, max_batch: int = 16) -> list[float]:
    return pm.SIMULATORS[policy](arrivals, prompts, outputs, costs, max_batch)


@pytest.mark.parametrize("policy", pm.POLICIES)
def test_a_single_request_takes_one_iteration_per_output_token(policy: str) -> None:
    for output in (1, 2, 7):
        assert run(policy, [3.0], [100], [output]) == [3.0 + output]


@pytest.mark.parametrize("policy", pm.POLICIES)
def test_a_single_request_costs_the_same_under_both_policies(policy: str) -> None:
    # prefill 1 + 0.5 * 10 + 0.01 * 10^2; two decodes of 1 + 1, at contexts 10 and 11
    costs = pm.Costs(1.0, 1.0, 0.5, 0.01, 1.0)
    assert run(policy, [0.0], [10], [3], costs) == pytest.approx([7.0 + 2 * 2 + 21])


def test_short_request_returns_early_only_under_orca() -> None:
    assert run("request", [0.0, 0.0], [50, 60], [2, 5]) == [5.0, 5.0]
    assert run("orca", [0.0, 0.0], [50, 60], [2, 5]) == [2.0, 5.0]


def test_a_request_arriving_during_a_request_level_batch_waits_for_it() -> None:
    assert run("request", [0.0, 1.0], [50, 60], [5, 3]) == [5.0, 8.0]
    # orca admits it into the iteration that starts at 1 (its prefill yields its first token)
    assert run("orca", [0.0, 0.5], [50, 60], [5, 3]) == [5.0, 4.0]


def test_request_level_prefill_runs_prompts_padded_to_the_longest() -> None:
    linear = pm.Costs(1.0, 0.0, 0.01, 0.0, 0.0)
    assert run("request", [0.0, 0.0], [10, 30], [1, 1], linear) == pytest.approx([1.6, 1.6])
    assert run("orca", [0.0, 0.0], [10, 30], [1, 1], linear) == pytest.approx([1.4, 1.4])
    square = pm.Costs(0.0, 0.0, 0.0, 1.0, 0.0)
    assert run("request", [0.0, 0.0], [10, 30], [1, 1], square) == [1800.0, 1800.0]
    assert run("orca", [0.0, 0.0], [10, 30], [1, 1], square) == [1000.0, 1000.0]


def test_max_batch_size_is_respected() -> None:
    five = [0.0] * 5
    assert run("request", five, [8] * 5, [3] * 5, max_batch=2) == [3, 3, 6, 6, 9]
    assert run("orca", five, [8] * 5, [3] * 5, max_batch=2) == [3, 3, 6, 6, 9]
    # orca fills a freed row at once: the third request joins at iteration 1
    assert run("orca", [0.0] * 3, [8] * 3, [1, 4, 4], max_batch=2) == [1, 4, 5]
    # decode cost counts the batch: b_decode = 1 per running request, at most 2 of them
    per_row = pm.Costs(0.0, 1.0, 0.0, 0.0, 0.0)
    assert run("orca", [0.0] * 3, [8] * 3, [2, 2, 2], per_row, max_batch=2) == [2, 2, 3]


def test_the_simulators_scale_to_a_sweep_point() -> None:
    args = pm.parse_args(["--num-requests", "2000", "--costs", "0,0,0,0,0"])
    stream = pm.make_stream(args, 0)
    costs = pm.Costs(0.0025, 0.0002, 0.00035, 6e-8, 5e-7)
    for policy in pm.POLICIES:
        saturation = pm.measure(policy, costs, float("inf"), [stream], args)
        point = pm.measure(policy, costs, 0.8 * saturation["request_throughput"], [stream], args)
        assert 0.7 < point["request_throughput"] / saturation["request_throughput"] < 0.85
        assert 0 < point["norm_latency"]["p50"] <= point["norm_latency"]["p90"]


def curve(policy: str, rates: list[float], latencies: list[float]) -> list[dict]:
    return [{"policy": policy, "rate": r, "request_throughput": r,
             "norm_latency": {"p50": y, "p90": 2 * y}} for r, y in zip(rates, latencies)]


def test_sustained_throughput_interpolates_below_saturation() -> None:
    points = (curve("orca", [1, 2, 3, 4], [1.0, 1.5, 2.5, 1.2])  # 4 is past saturation
              + curve("request", [0.5, 1, 1.5], [1.2, 1.8, 4.0]))
    table, rows = pm.ratios(points, {"orca": 3.5, "request": 2.0}, [2, 5])
    assert "orca/request" in table.splitlines()[0]
    two, five = rows
    assert two["limit"] == 2.0  # 2 x the lowest median
    assert two["throughput"]["orca"]["value"] == pytest.approx(2.5)  # 2 + 0.5 / 1.0
    assert two["throughput"]["request"]["value"] == pytest.approx(1 + 0.2 / 2.2 * 0.5)
    assert two["ratio"]["orca"] == pytest.approx(2.5 / (1 + 0.1 / 2.2))
    assert five["throughput"]["orca"] == {"value": 3, "lower_bound": True}  # 4 left out
    assert five["throughput"]["request"]["value"] == 1.5


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    truth = pm.Costs(0.003, 0.0002, 0.0004, 5e-8, 4e-7)
    rows = np.array([[d, p, p * p, d * n] for d in (0, 1, 4, 16) for p in (0, 32, 256, 512)
                     for n in (64, 320) if d or p], dtype=np.float64)
    seconds = np.array([truth.iteration(*r) for r in rows])
    fitted = pm.fit(rows, seconds)
    assert np.allclose(pm.dataclasses.astuple(fitted), pm.dataclasses.astuple(truth), rtol=1e-6)
    # a coefficient that comes out negative is fixed at 0, the others refitted
    noisy = seconds * (1 + 0.01 * rng.standard_normal(len(seconds))) - 8e-7 * rows[:, 3]
    clamped = pm.fit(rows, noisy)
    assert clamped.c == 0 and min(pm.dataclasses.astuple(clamped)) >= 0


def test_costs_path_runs_without_a_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "policy_model.json"
    pm.main(["--quick", "--costs", "0.0025,0.0002,0.00035,6e-8,5e-7", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "orca/request" in printed and "Sensitivity" in printed
    assert "a 272-token prompt costs 36.0 decode steps" in printed
    record = json.loads(out.read_text())
    assert [s["scale"] for s in record["sensitivity"]] == pm.QUICK["cost_scales"]
    assert record["sensitivity"][0]["ratios"][0]["ratio"]["orca"] > 1
