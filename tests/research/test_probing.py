"""Linear probes: the activations are the probes' own records; the fit is sklearn's multinomial
logistic regression (same objective); saved weights give back the reported held-out accuracy; the
CLI writes weights, summary and picture; bad data and sites are one line each."""

from __future__ import annotations

import json
import random
import xml.etree.ElementTree as ET

import pytest
import torch

from glassformer.cli import main
from glassformer.research.probing import (activations, fit_logistic, load_probes, site_names, split,
                                          train_probes)
from glassformer.tracing.interventions import run_with

from ..support import one_error, tiny_checkpoint

ANIMALS = ["cat", "dog", "bird"]
TEXT = " ".join(f"the {a} sat on the mat and the {a} ran home." for a in ANIMALS * 30)


def _labelled(n=60, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a = ANIMALS[i % 3]
        words = rng.sample(["the", "sat", "on", "mat", "ran", "home", "and"], 4)
        rows.append({"text": " ".join(words[:2] + [a] + words[2:]), "label": a})
    return rows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "ckpt"
    model, tok = tiny_checkpoint(path, TEXT)
    return path, model, tok


@pytest.mark.parametrize("site,position", [("resid_pre", "last"), ("attn.z", "mean"), ("ffn.act", "last")])
def test_activations_are_the_probes_records(ckpt, site, position):
    _, model, tok = ckpt
    texts = [r["text"] for r in _labelled(5)] + ["the cat sat on the mat and ran home"]  # different lengths
    names = site_names(model, site, [0, 1])
    got = activations(model, [tok.encode(t) for t in texts], names, position, batch=4)
    for L, name in names.items():
        for i, t in enumerate(texts):
            x = run_with(model, tok.encode(t), {}, record=[name])[1][name][0]  # (T, ...)
            x = x.reshape(x.shape[0], -1)
            want = x[-1] if position == "last" else x.double().mean(0).float()
            assert torch.allclose(got[L][i], want, atol=1e-5), (L, i)


def test_the_fit_is_sklearns_multinomial_logistic_regression():
    sklearn = pytest.importorskip("sklearn.linear_model")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 6, generator=g, dtype=torch.float64) * torch.tensor([1, 2, 3, 0.5, 1, 4.0])
    y = (x[:, :3] @ torch.randn(3, 3, generator=g, dtype=torch.float64) + torch.randn(120, 3, generator=g,
                                                                                        dtype=torch.float64)).argmax(-1)
    l2 = 1e-2
    W, b, mean, std = fit_logistic(x, y, 3, l2)
    xs = ((x - mean) / std).numpy()
    # sklearn minimises C·Σ loss + ½|W|², ours mean loss + ½·l2·|W|²: the same for C = 1 / (l2·n)
    ref = sklearn.LogisticRegression(C=1 / (l2 * len(y)), tol=1e-12, max_iter=10000).fit(xs, y.numpy())
    ours = torch.softmax(torch.from_numpy(xs) @ W.T + b, -1).numpy()
    assert abs(ours - ref.predict_proba(xs)).max() < 1e-4


def test_split_is_stratified_seeded_and_disjoint():
    labels = ["a"] * 10 + ["b"] * 3
    train, held = split(13, 0.25, 0, labels)
    assert sorted(train + held) == list(range(13)) and not set(train) & set(held)
    assert {labels[i] for i in held} == {"a", "b"} and split(13, 0.25, 0, labels) == (train, held)
    assert split(13, 0.25, 1, labels) != (train, held)


def test_the_probe_reads_the_label_and_its_saved_weights_score_as_reported(ckpt, tmp_path, capsys):
    path, model, tok = ckpt
    rows = _labelled(60)
    data = tmp_path / "animals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "probe"
    assert main(["probe", "train", "--checkpoint", str(path), "--data", str(data), "--site", "resid_post",
                 "--position", "mean", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["classes"] == sorted(ANIMALS) and summary["n_heldout"] == 15 and summary["baseline"] <= 0.34
    assert all(row["heldout_accuracy"] >= 0.9 for row in summary["layers"]), summary["layers"]
    ET.fromstring((out / "accuracy.svg").read_text())  # a well-formed picture
    assert (out / "probes.json").is_file()
    probes = load_probes(out)
    train, held = split(60, 0.25, 0, [r["label"] for r in rows])
    y = torch.tensor([sorted(ANIMALS).index(rows[i]["label"]) for i in held])
    for row in summary["layers"]:
        name = row["probe"]
        x = torch.stack([run_with(model, tok.encode(rows[i]["text"]), {}, record=[name])[1][name][0].mean(0)
                         for i in held])  # (n_held, D): recorded afresh
        acc = float((probes[row["layer"]].logits(x).argmax(-1) == y).double().mean())
        assert acc == pytest.approx(row["heldout_accuracy"])


def test_a_label_the_text_does_not_show_is_not_read(ckpt):
    """The control: labels drawn at random from the texts' content are near chance held out."""
    _, model, tok = ckpt
    rows = _labelled(90, seed=1)
    labels = [random.Random(i).choice(["x", "y"]) for i in range(90)]
    result = train_probes(model, tok, [r["text"] for r in rows], labels, "resid_post", [1], heldout=0.5, l2=1.0)
    assert result.layers[0].heldout_accuracy < 0.75


def test_bad_data_and_sites_are_one_line(ckpt, tmp_path, capsys):
    path, model, tok = ckpt
    base = ["probe", "train", "--checkpoint", str(path), "--out", str(tmp_path / "o")]

    def data(name, text):
        (tmp_path / name).write_text(text)
        return ["--data", str(tmp_path / name)]

    one_error(capsys, base + data("empty.jsonl", "\n") + ["--site", "resid_pre"], "no labelled text")
    one_error(capsys, base + data("one.jsonl", '{"text": "a cat", "label": 1}\n{"text": "a dog", "label": 1}\n')
              + ["--site", "resid_pre"], "one class only")
    one_error(capsys, base + data("bad.jsonl", '{"text": "a cat", "label": 1}\nnot json\n') + ["--site", "resid_pre"],
              "line 2", "not JSON")
    good = data("good.jsonl", "".join(json.dumps(r) + "\n" for r in _labelled(12)))
    one_error(capsys, base + good + ["--site", "attn.nothing"], "attn.nothing", "resid_pre", "attn.out", "ffn.down")
    one_error(capsys, base + good + ["--site", "resid_pre", "--layers", "0,5"], "--layers 0,5", "2 blocks")
