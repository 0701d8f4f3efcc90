"""Smoke test of the prefix caching benchmark (bench/prefix.py) on orca-tiny: both workloads,
caching off and on, the reuse it reports, and its plot."""
from __future__ import annotations

import json

import prefix


def test_prefix_benchmark_reports_reuse(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    prefix.main(["--model", "orca-tiny", "--num-requests", "6", "--system-len", "48",
                 "--question-len", "4", "8", "--output-len", "4", "--conversations", "2",
                 "--turns", "2", "--message-len", "8", "16", "--answer-len", "4",
                 "--json", str(out), "--plot", str(tmp_path / "prefix.png")])
    points = json.loads(out.read_text())["points"]
    assert [(p["workload"], p["rate"], p["caching"]) for p in points] == [
        ("system_prompt", 4.0, False), ("system_prompt", 4.0, True),
        ("system_prompt", "inf", False), ("system_prompt", "inf", True),
        ("multi_turn", None, False), ("multi_turn", None, True)]
    for p in points:
        assert p["completed"] == p["num_requests"]
        assert (p["cached_prompt_tokens"] > 0) == p["caching"]
    # Arriving together, the other five wait for the first's three system-prompt blocks.
    at_once = points[3]
    assert at_once["cached_prompt_tokens"] == 5 * 48
    assert at_once["prefix_cache_hits"] == 5 * 48
    assert "throughput on/off" in capsys.readouterr().out
    assert (tmp_path / "prefix.png").read_bytes().startswith(b"\x89PNG")
