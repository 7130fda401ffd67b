"""Session.run_ahead (each decode step queued before the host reads the token before it: the
GPU's default for one row) against the ordinary loop, checked on the CPU where both run
the same operations in another order of bookkeeping."""

import pytest
import torch

from glassformer.generation.session import Session

from ..support import tiny_model


def conversation(s: Session, stop: int | None) -> list:
    """Sends of every kind: greedy, seeded sampling with every filter and a penalty
    (abandoned midway), a stop token, a continuation long enough to slide a 24-token window
    in the middle of a send, a penalty strong enough to change greedy tokens; the state at
    the end."""
    out = [list(s.send([3, 1, 4, 1, 5, 9], max_new_tokens=7, greedy=True))]
    it = s.send([5], max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02,
                repetition_penalty=1.3, seed=3)
    out.append([next(it) for _ in range(4)])
    it.close()  # the consumer stops listening: a queued step must not count as cached
    out.append(list(s.send([9, 9], max_new_tokens=12, greedy=True, stop=None if stop is None else [stop])))
    out.append(list(s.send(None, max_new_tokens=14, seed=1, repetition_penalty=1.2)))  # slides mid-send (24)
    out.append(list(s.send([7], max_new_tokens=8, greedy=True, repetition_penalty=50.0)))  # seen tokens all but banned
    out.append(list(s.send([[2, 6]], max_new_tokens=3, greedy=True)))  # a batch of one: lists per step
    return out + [s.texts, s.starts, s.cached]


@pytest.mark.parametrize("policy, max_len", [("error", 64), ("slide", 24)])
@pytest.mark.parametrize("tensor_positions", [False, True])
def test_run_ahead_equals_the_ordinary_loop(policy, max_len, tensor_positions, monkeypatch):
    model = tiny_model()
    if tensor_positions:  # what a compiled step on a GPU gets: positions stepped on the device
        monkeypatch.setattr(Session, "_positions_as_tensor", lambda self: True)
    stop = None
    for _ in range(2):  # without a stop, then with the greedy send's fourth token as one
        plain = conversation(Session(model, max_len=max_len, context_policy=policy, run_ahead=False), stop)
        ahead = Session(model, max_len=max_len, context_policy=policy, run_ahead=True)
        assert conversation(ahead, stop) == plain
        assert (ahead.slides > 0) == (policy == "slide")
        stop = plain[2][3]
    assert plain[2][-1] == stop and len(plain[2]) <= 4


def copycat(model):
    """The model with every block's output zeroed and the head tied to the embedding, its rows
    of one length: the logits are each token's embedding against the current one's, largest
    for the current token itself, so greedy decoding repeats
    the last token forever unless a penalty forbids it."""
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wo.weight.zero_()
            b.ffn.w_down.weight.zero_()
        model.embed.weight.copy_(torch.nn.functional.normalize(model.embed.weight, dim=-1))  # rows of one length
        model.final_norm.weight.fill_(1.0)
        model.lm_head.weight = model.embed.weight
    return model


def test_run_ahead_penalises_the_token_the_host_has_not_read_yet():
    model = copycat(tiny_model())
    assert list(Session(model).send([5], max_new_tokens=3, greedy=True)) == [5, 5, 5]
    plain = list(Session(model, run_ahead=False).send([5], max_new_tokens=8, greedy=True, repetition_penalty=50.0))
    ahead = list(Session(model, run_ahead=True).send([5], max_new_tokens=8, greedy=True, repetition_penalty=50.0))
    assert ahead == plain and len(set(plain + [5])) == 9  # nothing repeats, not even the token just made


def test_run_ahead_of_no_tokens_runs_nothing():
    model = tiny_model()
    s = Session(model, run_ahead=True)
    assert list(s.send([1, 2, 3], max_new_tokens=0)) == [] and s.cached == [0]  # nothing fed yet
    assert list(s.send(None, max_new_tokens=4, greedy=True)) == list(
        Session(model).send([1, 2, 3], max_new_tokens=4, greedy=True))


def test_run_ahead_is_the_default_for_one_row_on_a_gpu_only():
    model = tiny_model()
    assert not Session(model).run_ahead and not Session(model, 2).run_ahead  # the CPU: nothing to overlap
    # Asked for with several rows, the ordinary loop serves them (run-ahead is for one row).
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    forced = list(Session(model, 2, run_ahead=True).send(prompts, max_new_tokens=5, greedy=True))
    assert forced == list(Session(model, 2).send(prompts, max_new_tokens=5, greedy=True)) and len(forced[0]) == 2


@pytest.mark.slow
def test_compiled_run_ahead_with_positions_on_the_device(monkeypatch):
    """The GPU's compiled path on the CPU: positions as a tensor (the whole cache read under the
    mask), stepped on the device between queued steps; tokens of an eager session."""
    model = tiny_model()
    eager = list(Session(model).send([2, 7, 1, 8], max_new_tokens=10, greedy=True))
    monkeypatch.setattr(Session, "_positions_as_tensor", lambda self: True)
    s = Session(model, compile=True, run_ahead=True)
    assert list(s.send([2, 7, 1, 8], max_new_tokens=10, greedy=True)) == eager
    assert s.cache.start is None  # the steps read the whole cache, masked
