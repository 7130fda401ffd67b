"""The main job end to end, shrunk: a tiny corpus, a few seconds of training, samples printed."""

from __future__ import annotations

from glassformer.cli import main

from .support import synthetic_text


def test_demo_runs_end_to_end(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(synthetic_text(400, 3))
    assert main(["demo", "--out", str(tmp_path / "demo"), "--corpus", str(corpus), "--budget", "4", "--tokens", "140",
                 "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- ") == 3 and "ROMEO:" in out
    assert (tmp_path / "demo" / "run" / "latest").is_file()
    assert (tmp_path / "demo" / "run" / "loss.png").is_file()
    page = tmp_path / "demo" / "trace.html"
    assert page.is_file() and "To be, or not to be" in page.read_text()
    assert "KV cache" in out  # the cost summary
