"""Smoke test of bench/vs_transformers.py on a few short requests: both transformers modes run,
agree with ours in float32, and every ratio is taken against the run of ours next to it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import vs_transformers  # noqa: E402


def test_each_ratio_is_against_the_adjacent_run_of_ours(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "vs.json"
    vs_transformers.main(["--model", "orca-tiny", "--dtype", "float32", "--num-requests", "4",
                          "--hf-batch-sizes", "2", "--hf-cb-batch-sizes",
                          "2", "--prompt-len", "16", "32", "--output-len", "1", "8",
                          "--json", str(out)])
    printed = capsys.readouterr().out
    assert "ours / transformers' best" in printed
    record = json.loads(out.read_text())
    results = record["results"]
    assert [r["mode"] for r in results] == ["static", "continuous"]
    for r in results:
        assert r["agreement"] == 1.0  # float32: the same greedy tokens
        assert r["ratio"] == pytest.approx(r["seconds"] / r["ours_seconds"])
    assert len(record["ours_seconds"]) == 3  # the first run, then one after each configuration
    best = max(results, key=lambda r: r["tokens_per_s"])
    assert record["best_overall"]["ratio"] == pytest.approx(best["ratio"])
