"""The plots of bench/vs_llamacpp.py (its run needs llama-cpp-python; the plot only its record)
and the note when matplotlib is missing."""
from __future__ import annotations

import sys

import vs_llamacpp

RECORD = {
    "one_stream": {"ours, stored formats, float32 activations": [1500.0, 140.0],
                   "llama.cpp, stored file": [320.0, 52.0]},
    "offline": {"ours, stored formats, float32 activations, B = 32":
                {"seconds": 11.0, "output_tokens_per_s": 205.0},
                "llama.cpp, stored file, B = 16": {"seconds": 57.0, "output_tokens_per_s": 40.0}},
}


def test_vs_llamacpp_plot_draws_each_section(tmp_path):
    paths = [tmp_path / "a.png", tmp_path / "sub" / "b.png"]
    vs_llamacpp.plot(RECORD, "title", paths)
    for path in paths:
        assert path.read_bytes().startswith(b"\x89PNG")
    one_section = tmp_path / "offline.png"
    vs_llamacpp.plot({"offline": RECORD["offline"]}, "title", [one_section])
    assert 0 < one_section.stat().st_size < paths[0].stat().st_size  # one panel, not three


def test_vs_llamacpp_plot_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    vs_llamacpp.plot(RECORD, "title", [tmp_path / "x.png"])
    assert "pip install 'orca_ext[bench]'" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()
