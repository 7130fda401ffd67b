"""Generation with a KV cache against full forwards, each prompt alone, and the sampling formulas."""

import math

import pytest
import torch

from glassformer import generate, speed
from glassformer.errors import UserError
from glassformer.generation.session import Session, apply_repetition_penalty, logits_to_probs, sample

from ..support import greedy_by_full_forward, tiny_model

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


@pytest.mark.parametrize("kernel", ["naive", "tiled", "sdpa"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_greedy_equals_argmax_of_full_forward(kernel, heads):
    model = tiny_model(n_kv_heads=HEADS[heads], attention=kernel, attention_tile=8)
    prompt = torch.randint(0, 512, (13,)).tolist()
    ref = greedy_by_full_forward(model, prompt, 16)
    assert list(generate(model, prompt, max_new_tokens=16, greedy=True)) == ref
    assert list(generate(model, prompt, max_new_tokens=16, temperature=0)) == ref


@pytest.mark.parametrize("kernel", ["naive", "sdpa"])
def test_batch_of_different_lengths_equals_each_alone(kernel):
    model = tiny_model(attention=kernel)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (3, 17, 1, 9)]
    alone = [list(generate(model, p, max_new_tokens=15, greedy=True)) for p in prompts]
    steps = list(generate(model, prompts, max_new_tokens=15, greedy=True))
    assert [[s[b] for s in steps] for b in range(len(prompts))] == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # the rows really differ


def test_batched_rows_stop_on_their_own_and_stay_exact():
    model = tiny_model()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 11)]
    alone = [list(generate(model, p, max_new_tokens=20, greedy=True)) for p in prompts]
    stop_id = alone[0][4]  # row 0 stops after its 5th token (if it came no earlier)
    cut = alone[0].index(stop_id) + 1
    session = Session(model, 2)
    steps = list(session.send(prompts, max_new_tokens=20, greedy=True, stop=[stop_id]))
    row0 = [s[0] for s in steps if s[0] is not None]
    row1 = [s[1] for s in steps if s[1] is not None]
    assert row0 == alone[0][:cut]
    assert all(s[0] is None for s in steps[cut:])
    if stop_id in alone[1]:
        assert row1 == alone[1][:alone[1].index(stop_id) + 1]
    else:
        assert row1 == alone[1]
    # The stopped row's cache stayed exact: continuing it equals a fresh run on its whole text.
    more = list(session.send([[7], [8]], max_new_tokens=6, greedy=True))
    for b in range(2):
        assert [s[b] for s in more] == greedy_by_full_forward(model, session.texts[b][:-6], 6)


def test_session_continuation_equals_one_shot():
    model = tiny_model()
    first, second = torch.randint(0, 512, (7,)).tolist(), torch.randint(0, 512, (4,)).tolist()
    s = Session(model)
    a = list(s.send(first, max_new_tokens=10, greedy=True))
    b = list(s.send(second, max_new_tokens=10, greedy=True))
    assert a == greedy_by_full_forward(model, first, 10)
    assert b == greedy_by_full_forward(model, first + a + second, 10)
    c = list(s.send(max_new_tokens=5, greedy=True))  # go on with no new text
    assert c == greedy_by_full_forward(model, first + a + second + b, 5)
    assert s.texts[0] == first + a + second + b + c


def test_slide_policy_keeps_the_latest_window():
    model = tiny_model(max_seq_len=24)
    prompt = torch.randint(0, 512, (10,)).tolist()
    with pytest.raises(UserError, match="context"):
        generate(model, prompt, max_new_tokens=40, greedy=True)
    got = list(generate(model, prompt, max_new_tokens=40, greedy=True, context_policy="slide", slide_keep=10))
    assert got == greedy_by_full_forward(model, prompt, 40, keep=10)
    # Batched rows slide on their own schedules and still match each alone.
    prompts = [prompt, prompt[:3]]
    steps = list(generate(model, prompts, max_new_tokens=40, greedy=True, context_policy="slide", slide_keep=10))
    assert [s[1] for s in steps] == greedy_by_full_forward(model, prompts[1], 40, keep=10)


def test_same_seed_same_tokens():
    model = tiny_model()
    prompt = [1, 2, 3]
    kw = dict(max_new_tokens=30, temperature=1.5, top_k=50, top_p=0.95)
    a = list(generate(model, prompt, seed=123, **kw))
    assert a == list(generate(model, prompt, seed=123, **kw))
    assert a != list(generate(model, prompt, seed=124, **kw))


def test_stop_sequence_ends_after_it():
    model = tiny_model()
    prompt = [5, 6, 7]
    full = list(generate(model, prompt, max_new_tokens=20, greedy=True))
    seq = full[6:8]
    got = list(generate(model, prompt, max_new_tokens=20, greedy=True, stop=[tuple(seq)]))
    first = next(i for i in range(len(full) - 1) if full[i:i + 2] == seq)
    assert got == full[:first + 2]


# ----------------------------------------------------------------------------- filters


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 50), (16, 2048)])
def test_first_argmax_is_argmax_ties_and_nan_included(rows, vocab):
    """The greedy pick (sampling.first_argmax, through max()) is torch's argmax: the first of equal
    maxima, and a NaN wherever argmax picks one."""
    from glassformer.generation.sampling import first_argmax

    g = torch.Generator().manual_seed(rows)
    x = torch.randint(0, 4, (rows, vocab), generator=g).float()  # (R, V) few values: many ties
    assert torch.equal(first_argmax(x), x.argmax(-1))
    x[0, vocab // 2] = float("nan")
    assert torch.equal(first_argmax(x), x.argmax(-1))
    assert torch.equal(first_argmax(x[:, None, :]), x[:, None, :].argmax(-1))  # (R, 1, V): the last axis


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    p = logits_to_probs(logits, top_k=2)
    assert int((p > 0).sum()) == 2
    assert set(p[0].nonzero().flatten().tolist()) <= {1, 2, 3}
    assert torch.allclose(p.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.5, 0.2, 0.15, 0.05]])
    logits = probs.log()
    for p, kept in [(0.5, {1}), (0.6, {1, 2}), (0.7, {1, 2}), (0.71, {1, 2, 3}), (0.86, {1, 2, 3, 0}), (1.0, {0, 1, 2, 3, 4})]:
        got = logits_to_probs(logits, top_p=p)[0]
        assert set(got.nonzero().flatten().tolist()) == kept, p
        want = torch.zeros(5)
        want[list(kept)] = probs[0, list(kept)] / probs[0, list(kept)].sum()
        assert torch.allclose(got, want, atol=1e-6)


def test_min_p_and_temperature():
    probs = torch.tensor([[0.4, 0.3, 0.19, 0.11]])
    got = logits_to_probs(probs.log(), min_p=0.5)[0]  # threshold 0.2: keeps 0.4 and 0.3
    assert torch.allclose(got, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=1e-6)
    hot = logits_to_probs(probs.log(), temperature=2.0)[0]  # p^(1/2), renormalised
    assert torch.allclose(hot, probs[0].sqrt() / probs[0].sqrt().sum(), atol=1e-6)


def test_repetition_penalty_is_ctrl():
    logits = torch.tensor([[2.0, -2.0, 2.0, -1.0, 0.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    out = apply_repetition_penalty(logits, seen, 1.3)
    assert torch.allclose(out, torch.tensor([[2.0 / 1.3, -2.0 * 1.3, 2.0, -1.0, 0.0]]))


def test_filters_match_hugging_face_processors():
    tr = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g)
    ids = torch.randint(0, 300, (4, 40), generator=g)
    seen = torch.zeros(4, 300, dtype=torch.bool).scatter_(1, ids, True)
    procs = tr.LogitsProcessorList([
        tr.RepetitionPenaltyLogitsProcessor(1.2), tr.TemperatureLogitsWarper(0.7), tr.TopKLogitsWarper(60),
        tr.TopPLogitsWarper(0.8), tr.MinPLogitsWarper(0.05),
    ])
    ref = torch.softmax(procs(ids, logits.clone()), -1)
    got = logits_to_probs(apply_repetition_penalty(logits, seen, 1.2), temperature=0.7, top_k=60, top_p=0.8, min_p=0.05)
    assert ((got > 0) == (ref > 0)).all()
    assert torch.allclose(got, ref, atol=1e-6)
    assert 1 < int((got[0] > 0).sum()) < 60  # the filters really cut


def test_seeded_sampling_matches_the_distribution():
    """Chi-square goodness of fit at a fixed seed: 40000 draws of the filtered distribution."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    target = logits_to_probs(logits[None], temperature=0.8, top_k=6, top_p=0.97)[0]
    assert (target[6:] == 0).all() and (target[:5] > 0).all()  # top-k cut two tokens; top-p kept the first five
    n = 40000
    draws = sample(logits.expand(n, -1), temperature=0.8, top_k=6, top_p=0.97, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=8).double()
    assert counts[target == 0].sum() == 0  # filtered tokens are never drawn
    keep = target > 0
    expected = n * target[keep].double()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    # Critical value at p = 0.001 by Wilson–Hilferty: a real bias of a percent gives chi2 in the hundreds.
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit)
    # The same test catches a sampler that ignores the temperature.
    wrong = n * logits_to_probs(logits[None], top_k=6, top_p=0.97)[0][keep].double()
    assert float(((counts[keep] - wrong) ** 2 / wrong).sum()) > crit


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top-p"),
    (dict(top_p=1.2), "top-p"),
    (dict(top_k=0), "top-k"),
    (dict(min_p=1.5), "min-p"),
    (dict(repetition_penalty=0.0), "penalty"),
])
def test_bad_sampling_parameters(kw, match):
    model = tiny_model()
    with pytest.raises(UserError, match=match):
        generate(model, [1, 2], max_new_tokens=3, **kw)


def test_bad_prompts():
    model = tiny_model()
    with pytest.raises(UserError, match="empty"):
        generate(model, [], max_new_tokens=3)
    with pytest.raises(UserError, match="vocabulary"):
        generate(model, [1, 512], max_new_tokens=3)
    with pytest.raises(UserError, match="vocabulary"):
        generate(model, [[1], [-1, 2]], max_new_tokens=3)
    with pytest.raises(UserError, match="context policy"):
        generate(model, [1], max_new_tokens=3, context_policy="wrap")


# ----------------------------------------------------------------------------- how a session holds the weights


@torch.no_grad()
def cached_steps(model, ids: torch.Tensor, n_prefill: int):
    """The model over ids (B, T) through a cache: a prefill of the first n_prefill tokens, then one
    step per token; (logits (B, T, V), the cache)."""
    from glassformer import KVCache

    B, T = ids.shape
    cache = KVCache.for_model(model, B, T)
    got = [model(ids[:, :n_prefill], cache=cache, pos=0)[0]]
    got += [model(ids[:, t:t + 1], cache=cache, pos=t)[0] for t in range(n_prefill, T)]
    return torch.cat(got, dim=1), cache


@pytest.mark.parametrize("over", [dict(), dict(norm="layer", ffn="gelu", pos="learned", bias=True, tie_embeddings=True)])
def test_a_session_with_or_without_speed_gives_the_plain_models_numbers(over):
    """An eager session's steps run the plain products whether or not speed is installed: the same
    logits to the bit, so the explorer and a session agree on every number."""
    plain, fast = tiny_model(**over), tiny_model(**over)
    got = {}
    for name, model, on in (("plain", plain, False), ("fast", fast, True)):
        s = Session(model, speed=on)
        got[name] = list(s.send([4, 2], max_new_tokens=6, greedy=True))
        ids = torch.tensor([[4, 2, *got[name][:-1]]])
        got[name + "_logits"] = cached_steps(model, ids, 2)[0]
    assert not speed.installed(plain) and speed.installed(fast)
    assert got["plain"] == got["fast"] == greedy_by_full_forward(plain, [4, 2], 6)
    assert torch.equal(got["plain_logits"], got["fast_logits"])


def test_prefill_runs_the_head_on_each_rows_last_token_only():
    from glassformer import KVCache
    from glassformer.generation.session import prefill

    model = tiny_model()
    ids = torch.randint(0, 512, (3, 9))
    lengths = torch.tensor([9, 4, 6])
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    with torch.no_grad():
        full, _ = model(ids)  # (B, T, V); rows are causal, so padding after a row's end changes nothing before it
        got = prefill(model, ids, KVCache.for_model(model, 3, 16), 0, lengths)  # (B, V)
    handle.remove()
    want = full[torch.arange(3), lengths - 1]
    assert got.shape == (3, 512) and seen == [(3, 9, 512), (3, 1, 512)]  # the head ran on 3 rows, not 27
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_sessions_follow_weights_changed_in_place_with_or_without_speed():
    model = tiny_model()
    prompt = [3, 1, 4, 1, 5]
    before = list(generate(model, prompt, max_new_tokens=12, greedy=True))
    unpacked = list(Session(model, speed=False).send(prompt, max_new_tokens=12, greedy=True))
    assert unpacked == before
    with torch.no_grad():  # change the weights in place: the next session reads them as they are now
        model.blocks[0].attn.wq.weight.mul_(-1.0)
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * 0.5)
    after = list(generate(model, prompt, max_new_tokens=12, greedy=True))
    assert after == greedy_by_full_forward(model, prompt, 12) and after != before


@pytest.mark.slow
def test_compiled_decode_step_smoke():
    model = tiny_model()
    prompt = [2, 7, 1, 8]
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    counters.clear()
    with fresh_cache():  # compile from scratch, so the lowering below runs (no cached graph)
        s = Session(model, compile=True)
        assert list(s.send(prompt, max_new_tokens=6, greedy=True)) == greedy_by_full_forward(model, prompt, 6)
    # One graph for every position: no break (CUDA graphs need one), no recompilation per step.
    assert not counters["graph_break"] and counters["frames"]["total"] == 1
    # On the CPU each step reads only the filled slots (a dynamic length in the one graph); on a GPU
    # the whole cache, masked, so that every step has one shape and a CUDA graph is captured once.
    assert s.cache.start == len(prompt) + 4 and s.cache.end == len(prompt) + 5
    # On the CPU the step's one-row products are row sums over (out, in) weights, loops that
    # inductor generates (faster than the BLAS kernels at one row): none of them may be lowered
    # to a library product (inductor counts each product it lowers to one).
    products = ("aten.baddbmm_", "aten.addmm_", "aten.mm_")
    assert sum(n for k, n in counters["aten_mm_info"].items() if k.startswith(products)) == 0


def test_compiled_steps_drop_the_held_guards_yet_stay_right():
    """A compiled session's step skips the guards on the model and cache
    (compiled.compile_step): another model's session must get its own step, a new thread
    count must recompile (the loops are split for the old one) and still give the same
    tokens, and the shape guards must stay."""
    a, b = tiny_model(), tiny_model(seed=1, dim=96, ffn_dim=256, n_layers=3)
    prompt = [3, 1, 4, 1]
    sa, sb = Session(a, compile=True), Session(b, compile=True)
    assert list(sa.send(prompt, max_new_tokens=5, greedy=True)) == greedy_by_full_forward(a, prompt, 5)
    # A one-token prompt: the first decode step runs at position 1, which torch compiles as a
    # constant; only the shape guards it keeps send position 2 to a general recompile.
    assert list(sb.send([3], max_new_tokens=5, greedy=True)) == greedy_by_full_forward(b, [3], 5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        step = sa._compiled
        more = list(sa.send(None, max_new_tokens=4, greedy=True))
        assert sa._compiled is not step  # compiled anew for this thread count
    finally:
        torch.set_num_threads(before)
    assert more == greedy_by_full_forward(a, prompt, 9)[5:]
    # Every session's step got the guard filter: torch.compile takes it out of the options it
    # is given, which once left every step after the first with all its guards.
    from glassformer.generation.compiled import CPU_STEP_OPTIONS, _step_guards
    assert CPU_STEP_OPTIONS["guard_filter_fn"] is _step_guards


@pytest.mark.slow
def test_compiled_batch_of_different_lengths_equals_each_alone():
    """A compiled session's step on rows of different lengths: products of several rows over
    the (out, in) weights, per-row positions and the padding mask, in the compiled graph."""
    model = tiny_model()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (3, 11, 6)]
    alone = [list(generate(model, p, max_new_tokens=8, greedy=True)) for p in prompts]
    steps = list(Session(model, 3, compile=True).send(prompts, max_new_tokens=8, greedy=True))
    assert [[s[b] for s in steps] for b in range(3)] == alone


def test_session_reset_starts_a_new_text_in_the_same_cache():
    model = tiny_model()
    s = Session(model, max_len=32)
    first = list(s.send([5, 6, 7, 8, 9, 10], max_new_tokens=8, greedy=True))
    s.reset()
    again = list(s.send([3, 1, 4], max_new_tokens=8, greedy=True))  # shorter: stale slots beyond it stay
    assert again == greedy_by_full_forward(model, [3, 1, 4], 8) and s.texts[0][:3] == [3, 1, 4]
    assert first == greedy_by_full_forward(model, [5, 6, 7, 8, 9, 10], 8)


@pytest.mark.slow
def test_the_gpu_step_options_compile_to_the_same_tokens():
    """The GPU's compile options (CUDA graphs, the guard filter) checked where CUDA graphs are
    skipped (CPU tensors): an option that inductor refuses, or one that changes the math,
    fails here rather than on the first GPU run."""
    from glassformer.generation.compiled import CUDA_STEP_OPTIONS, _step_guards, compile_step

    model = tiny_model()
    prompt = [2, 7, 1, 8]
    s = Session(model, compile=True)
    s._compiled = compile_step(torch.device("cuda"))  # what a session on a GPU compiles
    assert list(s.send(prompt, max_new_tokens=6, greedy=True)) == greedy_by_full_forward(model, prompt, 6)
    # and compiling left the module's options whole (torch.compile pops guard_filter_fn from what it is given)
    assert CUDA_STEP_OPTIONS == {"guard_filter_fn": _step_guards, "triton.cudagraphs": True}


@pytest.mark.gpu
def test_cuda_graphs_read_the_weights_in_place():
    """A compiled session on a GPU: the CUDA graph holds no second copy of the weights (it
    would copy them in before every replay) and gives the tokens of full forwards."""
    import copy

    model = tiny_model(dim=768, n_layers=6, ffn_dim=2048, vocab_size=8192)  # ~180 MB: well above workspaces
    prompt = [2, 7, 1, 8]
    ref = greedy_by_full_forward(model, prompt, 8)
    gpu = copy.deepcopy(model).cuda()
    weight_bytes = sum(p.numel() * p.element_size() for p in gpu.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    s = Session(gpu, max_len=32, compile=True)
    assert list(s.send(prompt, max_new_tokens=8, greedy=True)) == ref
    torch.cuda.synchronize()
    cache_bytes = sum(b.numel() * b.element_size() for b in s.cache.buffers())
    assert torch.cuda.memory_allocated() - before < cache_bytes + weight_bytes / 2
