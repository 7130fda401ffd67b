"""GlassformerLM against the harness's own `hf` model on the same tiny random Llama, the rolling
score against the project's own scorer, and `glassformer eval --tasks` end to end. No download:
the tasks are YAML + JSONL written by tests/harness/fixtures.py, datasets and the Hub offline."""

from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np
import pytest
import torch

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from glassformer.cli import main  # noqa: E402
from glassformer.harness.lm import GlassformerLM  # noqa: E402
from glassformer.train.evaluate import score  # noqa: E402

from ..support import synthetic_text, tiny_checkpoint  # noqa: E402
from .fixtures import CONTEXT, mc_docs, tiny_hf_llama, write_tasks  # noqa: E402

TOL = 1e-4  # nats, per request


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    hf_dir = tiny_hf_llama(root / "hf")
    tasks = write_tasks(root / "tasks")
    ours = GlassformerLM(checkpoint=str(hf_dir), device="cpu", batch_size=8)
    hf = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=8, dtype="float32")
    manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
    return {"root": root, "hf_dir": hf_dir, "tasks": tasks, "ours": ours, "hf": hf, "manager": manager}


@pytest.fixture(scope="module")
def results(world):
    """Both models through the harness's simple_evaluate on the multiple-choice and rolling tasks."""
    return {name: simple_evaluate(model=world[name], tasks=["tiny_mc", "tiny_ppl"], task_manager=world["manager"],
                                  log_samples=True)
            for name in ("ours", "hf")}


def _resps(result, task):
    return [[r[0] for r in s["resps"]] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_every_loglikelihood_equals_the_hf_model_and_the_accuracies_are_identical(results):
    ours, hf = _resps(results["ours"], "tiny_mc"), _resps(results["hf"], "tiny_mc")
    assert [len(d) for d in ours] == [len(d) for d in hf] and sum(len(d) for d in ours) > 30
    for a, b in zip(ours, hf):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a, b):
            assert abs(ll_a - ll_b) < TOL and greedy_a == greedy_b
    lls = [ll for d in ours for ll, _ in d]
    assert max(lls) - min(lls) > 10  # far from uniform: the comparison can fail
    for metric in ("acc,none", "acc_norm,none"):
        assert results["ours"]["results"]["tiny_mc"][metric] == results["hf"]["results"]["tiny_mc"][metric]


def test_rolling_loglikelihood_equals_the_hf_model(results, world):
    ours, hf = _resps(results["ours"], "tiny_ppl"), _resps(results["hf"], "tiny_ppl")
    assert len(ours) == len(hf) == 6
    for (a,), (b,) in zip(ours, hf):
        assert abs(a - b) < TOL
    texts = [json.loads(x)["text"] for x in world["tasks"]["tiny_ppl"].with_suffix(".jsonl").read_text().splitlines()]
    assert max(len(world["ours"].tok_encode(t)) for t in texts) > 2 * CONTEXT  # several windows each
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        a, b = results["ours"]["results"]["tiny_ppl"][metric], results["hf"]["results"]["tiny_ppl"][metric]
        assert a == pytest.approx(b, rel=1e-5)


def _project_score(model, windows) -> float:
    """The eval command's scorer over each (context, scored) window: a full forward, no cache."""
    total = 0.0
    for ctx, pred in windows:
        ids = np.asarray(ctx + pred)
        mask = np.asarray([0] * len(ctx) + [1] * len(pred))
        nats, n = score(model, ids, len(ids) - 1, "cpu", mask=mask)
        assert n == len(pred)
        total -= nats
    return total


def test_rolling_equals_the_projects_scoring_of_the_prefix_token_and_the_text(world):
    lm = world["ours"]
    text = synthetic_text(12, 5)
    ids = lm.tok_encode(text)
    assert len(ids) % CONTEXT != 0  # a short last window, which reads back into the one before
    windows = lm.rolling_windows(text)
    assert [t for _, p in windows for t in p] == ids and windows[0][0] == [lm.prefix_token_id]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    assert got == pytest.approx(_project_score(lm.model, windows), abs=TOL)
    # A text of whole windows: exactly the eval command's non-overlapping windows of prefix + text.
    whole = lm.tok_decode(ids[: 3 * CONTEXT])
    assert lm.tok_encode(whole) == ids[: 3 * CONTEXT]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (whole,), 0)], disable_tqdm=True)[0]
    nats, n = score(lm.model, np.asarray([lm.prefix_token_id] + ids[: 3 * CONTEXT]), CONTEXT, "cpu")
    assert n == 3 * CONTEXT and got == pytest.approx(-nats, abs=TOL)


def test_a_shared_context_is_prefilled_once(world):
    """Four choices of one question: the question's tokens go through the model once."""
    lm = world["ours"]
    fed = []
    hook = lm.model.embed.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    try:
        q = "the king and queen walk to the castle where"
        reqs = [Instance("loglikelihood", {}, (q, c), i) for i, c in enumerate([" a knight", " the old man sings",
                                                                               " the sea", " his sword"])]
        got = lm.loglikelihood(reqs, disable_tqdm=True)
    finally:
        hook.remove()
    n_q = len(lm.tok_encode(q))
    tails = [len(lm.tok_encode(q + r.args[1])) - n_q - 1 for r in reqs]
    assert len(fed) == 2 and fed[0] == n_q and fed[1] == len(reqs) * max(tails)  # one prefill, one padded step
    for r, (ll, _) in zip(reqs, got):  # each equal to the harness's own model
        assert ll == pytest.approx(world["hf"].loglikelihood([r], disable_tqdm=True)[0][0], abs=TOL)


def test_generate_until_stops_where_the_hf_model_stops(world):
    ours, hf = world["ours"], world["hf"]
    prompts = ["the king and queen", "a knight waits with his sword while the", "stars"]
    free = {"until": [], "max_gen_toks": 12, "do_sample": False}
    full = hf.generate_until([Instance("generate_until", {}, (p, free), i) for i, p in enumerate(prompts)], True)
    assert ours.generate_until([Instance("generate_until", {}, (p, free), i) for i, p in enumerate(prompts)], True) == full
    # Stop strings that the greedy text reaches midway: each row ends there, the stop not included.
    stops = [t[3:5] for t in full]
    kw = {"until": stops, "max_gen_toks": 12, "do_sample": False}
    reqs = [Instance("generate_until", {}, (p, kw), i) for i, p in enumerate(prompts)]
    want = hf.generate_until(reqs, True)
    assert ours.generate_until(reqs, True) == want
    assert all(len(w) < len(f) for w, f in zip(want, full))


def test_registered_under_its_name_and_built_from_model_args(world):
    cls = get_model("glassformer")
    assert cls is GlassformerLM
    lm = cls.create_from_arg_string(f"checkpoint={world['hf_dir']},batch_size=4,device=cpu",
                                    {"batch_size": None, "device": None})
    assert lm.batch_size == 4 and lm.max_length == CONTEXT
    q8 = cls.create_from_arg_string(f"checkpoint={world['hf_dir']},quantize=int8")
    r = [Instance("loglikelihood", {}, ("the king", " and queen"), 0)]
    a, b = q8.loglikelihood(r, disable_tqdm=True)[0][0], world["ours"].loglikelihood(r, disable_tqdm=True)[0][0]
    assert a != b and a == pytest.approx(b, abs=0.5)  # int8 weights: close, not equal


def test_eval_tasks_prints_the_table_then_one_json_line(world, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    tiny_checkpoint(ckpt, synthetic_text(200, 3))
    mc = world["tasks"]["tiny_mc"]
    rc = main(["eval", "--checkpoint", str(ckpt), "--tasks", "tiny_mc", "--include-path", str(mc.parent),
               "--limit", "9", "--batch-size", "4", "--output-path", str(tmp_path / "out")])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and any("tiny_mc" in line and "|" in line for line in out[:-1])
    line = json.loads(out[-1])
    assert set(line) == {"tasks", "limit", "num_fewshot"} and line["limit"] == 9 and line["num_fewshot"] is None
    t = line["tasks"]["tiny_mc"]
    assert set(t) == {"acc", "acc_stderr", "acc_norm", "chance", "acc_centered", "acc_centered_stderr"}
    c = float(np.mean([1 / len(d["choices"]) for d in mc_docs(mc)[:9]]))
    assert t["chance"] == pytest.approx(c, abs=1e-6)
    assert t["acc_centered"] == pytest.approx((t["acc"] - c) / (1 - c), abs=1e-5)
    assert t["acc_centered_stderr"] == pytest.approx(t["acc_stderr"] / (1 - c), abs=1e-5)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["results"]["tiny_mc"]["acc,none"] == t["acc"]


def test_eval_refuses_data_with_tasks_and_names_offline_for_an_uncached_dataset(world, tmp_path, capsys):
    for both_or_neither in (["--data", "x.txt", "--tasks", "tiny_mc"], []):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--checkpoint", str(world["hf_dir"]), *both_or_neither])
        assert e.value.code == 2
    capsys.readouterr()
    task = tmp_path / "remote.yaml"
    task.write_text(world["tasks"]["tiny_mc"].read_text().replace("dataset_path: json", "dataset_path: glassformer-tests/absent")
                    .replace("task: tiny_mc", "task: remote_mc"))
    assert main(["eval", "--checkpoint", str(world["hf_dir"]), "--tasks", str(task)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "HF_DATASETS_OFFLINE" in err and "Traceback" not in err


def test_the_harness_command_line_runs_glassformer(world, monkeypatch, capsys):
    """`python -m glassformer.harness ARGS` is `lm_eval ARGS` with the glassformer model registered
    (run in this process; the harness's index of its own tasks is left out, it takes half a minute)."""
    import lm_eval.tasks

    from glassformer.harness.__main__ import main as harness_main

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    monkeypatch.setattr(sys, "argv", ["lm_eval", "run", "--model", "glassformer", "--model_args",
                                      f"checkpoint={world['hf_dir']}", "--tasks", "tiny_mc",
                                      "--include_path", str(world["root"] / "tasks"), "--limit", "3", "--device", "cpu"])
    harness_main()
    out = capsys.readouterr().out
    assert "glassformer" in out and "tiny_mc" in out and "acc" in out


def _full_forward_loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    """The naive reference: one forward over context + continuation, no cache."""
    ids = torch.tensor([ctx + cont])
    logp = model(ids[:, :-1])[0].float().log_softmax(-1)[0, len(ctx) - 1:]  # (len(cont), V)
    return float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())


def test_an_adapter_run_is_scored_on_its_base(tmp_path):
    """checkpoint= an adapter run: its base with the adapter put on, through load (as every verb)."""
    from glassformer.checkpoint.adapters import save_adapter
    from glassformer.checkpoint.loading import load
    from glassformer.convert.lora import LoraConfig, apply_lora, lora_modules

    base, tok = tiny_checkpoint(tmp_path / "base", synthetic_text(200, 4))
    adapted, _ = load(tmp_path / "base")
    apply_lora(adapted, LoraConfig(r=2, alpha=4.0, targets=("wq", "wv", "w_down")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(adapted).values():  # nonzero A and B: an adapter that changes the numbers
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.1)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
    save_adapter(tmp_path / "adapter", adapted, tmp_path / "base", tok)
    lm = GlassformerLM(checkpoint=str(tmp_path / "adapter"), device="cpu")
    reqs = [Instance("loglikelihood", {}, ("the king and queen walk", c), i) for i, c in enumerate([" to the", " of"])]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    with torch.no_grad():
        for r, (ll, _) in zip(reqs, got):
            ctx, cont = lm._encode_pair(*r.args)
            assert ll == pytest.approx(_full_forward_loglikelihood(adapted.eval(), ctx, cont), abs=TOL)
            assert abs(ll - _full_forward_loglikelihood(base, ctx, cont)) > 1e-3
