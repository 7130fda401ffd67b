"""The explorer's Training view (`glassformer view --run RUN`, `train --snapshot-every N`): the
snapshots survive --keep-last pruning (and a resume), GET /api/run's curves are metrics.jsonl's,
a trace at a checkpoint is that checkpoint's own trace, and a checkpoint the run does not have is
refused by name (404) without a path ever being joined. The browser half: test_viewer_training_browser.py."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from glassformer.checkpoint.folders import SNAPSHOTS, prune
from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.commands import view
from glassformer.tracing.interventions import logit_lens_top
from glassformer.tracing.trace import trace
from glassformer.viewer.server import make_explorer_app

from ..support import make_prepared

TEXT = "the cat sat on the mat"
STEPS, EVERY, SNAP = 24, 12, 6
TRAIN = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-tokens", "512", "--log-every", "2",
         "--warmup-steps", "4", "--lr", "1e-2", "--keep-last", "1", "--no-progress", "--threads", "1", "--seed", "5"]
NAMES = [f"step-{s:06d}" for s in range(SNAP, STEPS + 1, SNAP)]


def train_run(data, out, *more) -> None:
    assert main(["train", "--data", str(data), "--out", str(out), *TRAIN, "--max-steps", str(STEPS),
                 "--eval-every", str(EVERY), "--snapshot-every", str(SNAP), "--stats-every", str(SNAP), *more]) == 0


def run_explorer(run, *flags):
    p = argparse.ArgumentParser()
    view.add_arguments(p)
    return view.build_explorer(p.parse_args(["--run", str(run), *flags]))


@pytest.fixture(scope="session")
def training_run(tmp_path_factory):
    """(prepared data, run folder): a tiny run of 24 steps, a snapshot every 6, evaluations at 12
    and 24, --keep-last 1; trained once for this file and the browser test's."""
    root = tmp_path_factory.mktemp("training")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = make_prepared(root / "data")
        train_run(data, root / "run")
    finally:
        torch.set_num_threads(n)
    return data, root / "run"


@pytest.fixture(scope="session")
def trained(training_run):
    """The run folder and its explorer (`view --run RUN`), shared with the browser test."""
    run = training_run[1]
    return run, run_explorer(run)


@pytest.fixture(scope="module")
def client(trained, one_thread):
    from starlette.testclient import TestClient

    return TestClient(make_explorer_app(trained[1]), base_url="http://127.0.0.1", raise_server_exceptions=False)


def test_snapshots_survive_pruning_and_a_resume(training_run, tmp_path):
    data, run = training_run
    assert sorted(p.name for p in run.glob("step-*")) == NAMES
    assert (run / SNAPSHOTS).read_text().split() == NAMES
    # Without the list, --keep-last 1 keeps only the newest (and the best, which is it here).
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    (bare / SNAPSHOTS).unlink()
    prune(bare, 1, {(bare / "best").read_text().strip(), "step-000024"})
    assert sorted(p.name for p in bare.glob("step-*")) == sorted({"step-000024", (run / "best").read_text().strip()})
    # A run stopped after step 18, resumed: it keeps the snapshots it had, and makes the rest.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "step-000024")
    (resumed / "latest").write_text("step-000018\n")
    (resumed / SNAPSHOTS).write_text("".join(n + "\n" for n in NAMES[:3]))
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 0
    assert sorted(p.name for p in resumed.glob("step-*")) == NAMES
    assert (resumed / SNAPSHOTS).read_text().split() == NAMES


def test_the_run_payload_equals_metrics_jsonl(trained, client):
    run, _ = trained
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines() if s.strip()]
    got = client.get("/api/run").json()
    train = [r for r in lines if "loss" in r]
    val = [r for r in lines if "val_loss" in r]
    assert got["curves"]["train"]["step"] == [r["step"] for r in train]
    assert got["curves"]["train"]["loss"] == [r["loss"] for r in train]
    assert got["curves"]["val"] == {"step": [r["step"] for r in val], "loss": [r["val_loss"] for r in val],
                                    "bpb": [r["val_bpb"] for r in val]}
    ratio = val[0]["val_bpb"] / val[0]["val_loss"]  # bits per byte per nat per token of the held-out text
    assert got["curves"]["train"]["bpb"] == pytest.approx([r["loss"] * ratio for r in train], rel=1e-12)
    stats = [r for r in lines if "stats" in r]
    assert got["stats"]["grad_norm"]["step"] == [r["step"] for r in stats] == list(range(SNAP, STEPS + 1, SNAP))
    for kind in ("grad_norm", "update_rms_ratio", "stream_rms"):
        for name in stats[0]["stats"][kind]:
            assert got["stats"][kind]["series"][name] == [r["stats"][kind][name] for r in stats], (kind, name)
    heads = stats[0]["stats"]["attn_entropy"]["blocks.0.attn"]
    for h in range(len(heads)):
        assert got["stats"]["attn_entropy"]["series"][f"blocks.0.attn[{h}]"] == [
            r["stats"]["attn_entropy"]["blocks.0.attn"][h] for r in stats]
    snaps = {c["name"]: c for c in got["checkpoints"]}
    assert list(snaps) == NAMES and all(c["snapshot"] for c in snaps.values())
    assert snaps["step-000024"]["latest"] and snaps["step-000012"]["val_loss"] == val[0]["val_loss"]
    model = load(run / "step-000024")[0]
    assert got["params"] == {k: list(v.shape) for k, v in model.state_dict().items()}


def test_a_trace_at_a_checkpoint_is_its_own(trained, client):
    run, _ = trained
    name = "step-000006"
    res = client.post("/api/trace", json={"text": TEXT, "checkpoint": name})
    assert res.status_code == 200
    got = res.json()
    assert got["checkpoint"] == name and got["run"] == run.name
    model, tok = load(run / name)
    ids = tok.encode(TEXT)
    ref = trace(model.eval(), ids)
    for i in range(model.config.n_layers):
        w = torch.tensor([[[float("nan") if x is None else x for x in r] for r in row]
                          for row in got["trace"]["probes"][f"blocks.{i}.attn.weights"]["data"]])
        assert torch.allclose(w, ref[f"blocks.{i}.attn.weights"].float(), atol=2e-6, equal_nan=True)
    lens = logit_lens_top(model, ids, 3)
    assert got["lens"]["ids"] == lens["ids"]
    assert torch.allclose(torch.tensor(got["lens"]["probs"]), torch.tensor(lens["probs"]), atol=1e-4)
    # The page the server opens with is the latest's; the early checkpoint's maps differ from it.
    latest = client.post("/api/trace", json={"text": TEXT}).json()
    assert latest["checkpoint"] == "step-000024"
    early, late = (p["trace"]["probes"]["blocks.0.attn.weights"]["data"] for p in (got, latest))
    assert max(abs(a - b) for ra, rb in zip(early, late) for ha, hb in zip(ra, rb)
               for a, b in zip(ha, hb) if a is not None) > 0.01
    # A calculation asked at that checkpoint is of its numbers.
    calc = client.post("/api/explain", json={"text": TEXT, "checkpoint": name, "probe": "blocks.0.attn.weights",
                                             "index": [2, 0, 1]}).json()
    assert calc["value"] == pytest.approx(float(ref["blocks.0.attn.weights"][2, 0, 1]), abs=1e-6)


@pytest.mark.parametrize("name", ["step-999999", "../step-000006", "/etc/passwd", "step-000006/../../x", "latest"])
def test_a_checkpoint_the_run_lacks_is_refused_by_name(client, name):
    for path, extra in (("/api/trace", {}), ("/api/explain", {"probe": "embed", "index": [0, 0]}),
                        ("/api/sample", {"position": 0})):
        res = client.post(path, json={"text": TEXT, "checkpoint": name, **extra})
        assert res.status_code == 404, (path, res.text)
        msg = res.json()["error"]
        assert f"has no checkpoint {name!r}" in msg and "step-000006, step-000012" in msg


def test_bad_run_requests(client):
    assert client.post("/api/trace", json={"text": TEXT, "checkpoint": 6}).status_code == 400
    res = client.post("/api/update", json={"step": -1, "param": "embed.weight", "index": [0, 0]})
    assert res.status_code == 400 and "step" in res.json()["error"]


def test_without_a_run_there_is_no_training_view(trained):
    from starlette.testclient import TestClient

    from glassformer.viewer import source

    c = TestClient(make_explorer_app(source.worked_explorer()), base_url="http://127.0.0.1")
    res = c.get("/api/run")
    assert res.status_code == 404 and "--run" in res.json()["error"]
    assert "run" not in c.post("/api/trace", json={}).json()
    res = c.post("/api/trace", json={"checkpoint": "step-000006"})
    assert res.status_code == 400 and "without --run" in res.json()["error"]


def test_view_run_options(trained, capsys):
    run, _ = trained
    assert main(["view", "--run", str(run), "--worked"]) == 2
    assert main(["view"]) == 2
    err = capsys.readouterr().err
    assert "error: --run shows a training run's checkpoints" in err and "error: give --checkpoint CKPT, --run RUN" in err
    ex = run_explorer(run, "--checkpoint", str(run / "step-000012"))
    assert ex.checkpoint == "step-000012" and ex.payload(TEXT)["checkpoint"] == "step-000012"
    with pytest.raises(Exception, match="holds no complete training checkpoint"):
        run_explorer(run / "step-000012")


def test_one_update_explained_through_the_route(trained, client):
    """POST /api/update answers explaining.optimizer.explain_update's calculation (its whole
    tensors left out), the update after the named checkpoint, equal to the optimizer's bitwise."""
    res = client.post("/api/update", json={"step": 12, "param": "blocks.0.attn.wq.weight", "index": [0, 1]})
    assert res.status_code == 200, res.text
    got = res.json()
    assert got["bitwise"] is True and got["summary"]["update_step"] == 13
    assert got["probe"] == "blocks.0.attn.wq.weight" and got["index"] == [0, 1]
    assert not {"grad", "clipped", "new_param"} & set(got)
    res = client.post("/api/update", json={"step": 7, "param": "blocks.0.attn.wq.weight", "index": [0, 1]})
    assert res.status_code == 400
