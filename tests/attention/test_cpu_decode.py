"""The CPU decode steps' attention kernel (attention/cpu_decode.cpp) against the naive kernel, its
building and fallback, and its place in a compiled session and in a continuous-batching step."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from glassformer.attention import cpu_decode
from glassformer.attention.naive import naive_attention
from glassformer.generation.session import Session
from glassformer.kv_cache import KVCache

from ..support import batched_step, tiny_model
from ..support import greedy_by_full_forward

pytestmark = pytest.mark.skipif(not cpu_decode.load(), reason="the C++ kernel cannot be built here (no compiler)")


def reference(q, k, v, scale):
    """The naive kernel, one query per row at the last position, the key/value heads repeated."""
    B, N, _, H = q.shape
    T, G = k.shape[2], N // k.shape[1]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, N, T, H)
    q_pos = torch.full((B, 1), T - 1)
    return naive_attention(q.double(), kr.double(), vr.double(), q_pos=q_pos, scale=scale).float()


@pytest.mark.parametrize("H", cpu_decode.HEAD_DIMS)
@pytest.mark.parametrize("K,G", [(2, 3), (1, 1), (2, 4), (1, 6), (3, 5)])
def test_kernel_equals_naive_attention(H, K, G):
    """Every head size it is built for and group sizes that take every path of its grouping
    (1-4 query heads at a time, remainders); lengths around its blocks of 4 positions; two rows;
    the keys and values read as views into a longer cache; stretches of positions merged."""
    B, S = 2, 700
    kc, vc = torch.randn(B, K, S, H), torch.randn(B, K, S, H)
    q = torch.randn(B, K * G, 1, H) * 3  # large scores: the softmax's max matters
    for T in (1, 3, 4, 5, 17, 300, 650):
        k, v = kc[:, :, :T], vc[:, :, :T]
        want = reference(q, k, v, H ** -0.5)
        for chunks in (0, 1, 2, 3):
            got = cpu_decode.attention(q, k, v, H ** -0.5, chunks)
            assert got.shape == (B, K * G, 1, H)
            assert (got - want).abs().max() < 1e-5, (T, chunks)  # fp32 against float64


@pytest.mark.parametrize("H", cpu_decode.HEAD_DIMS)
def test_each_row_reads_its_own_keys(H):
    """lens: row b reads only its first lens[b] keys, as a continuous-batching step's rows at their own
    positions do (the naive kernel with each row's query at position lens[b] - 1); beyond T reads all T;
    none: zeros, as from the naive kernel. Stretches of positions merged where a row ends inside one."""
    K, G, S, T = 2, 3, 400, 350
    lens = torch.tensor([1, 5, 300, 0, 1000, 17, 349])
    B = len(lens)
    kc, vc = torch.randn(B, K, S, H), torch.randn(B, K, S, H)
    q = torch.randn(B, K * G, 1, H) * 3
    k, v = kc[:, :, :T], vc[:, :, :T]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, N, T, H)
    q_pos = (lens.clamp(max=T) - 1)[:, None]  # (B, 1): the row at lens 0 reads nothing
    want = naive_attention(q.double(), kr.double(), vr.double(), q_pos=q_pos, scale=H ** -0.5).float()
    assert want[3].abs().max() == 0
    for chunks in (0, 1, 3):
        got = cpu_decode.attention(q, k, v, H ** -0.5, chunks, lens)
        assert (got - want).abs().max() < 1e-5, chunks
    every = cpu_decode.attention(q, k, v, H ** -0.5, 0, torch.full((B,), T))
    assert (every - cpu_decode.attention(q, k, v, H ** -0.5)).abs().max() == 0  # lens T: all of them
    with pytest.raises(ValueError, match="wants lens"):
        cpu_decode.attention(q, k, v, 1.0, 0, lens[:3])


def test_a_batched_step_at_each_rows_position_calls_the_kernel(monkeypatch):
    """A continuous-batching step (rows at their own positions, plain causal) goes through the kernel once
    a layer where it is built, with the logits of the two batched products it replaces (cpu_decode.enabled off)."""
    model = tiny_model()  # head size 16
    B, P = 3, 10
    ids = torch.randint(0, model.config.vocab_size, (B, P))
    step = torch.randint(0, model.config.vocab_size, (B, 1))
    pos = torch.tensor([4, 9, 2])

    def run():
        cache = KVCache.for_model(model, B)
        with torch.no_grad():
            model(ids, cache=cache.view(0, B), pos=0)  # every row's first P slots
            with torch.profiler.profile() as prof:
                logits, _ = model(step, cache=cache.view(0, B, 16), pos=pos)
        return logits, sum(e.count for e in prof.key_averages() if e.key == "glassformer::cpu_decode_attention")

    got, calls = run()
    assert calls == model.config.n_layers
    monkeypatch.setattr(cpu_decode, "enabled", False)
    want, calls = run()
    assert calls == 0
    assert (got - want).abs().max() < 1e-4


def test_threads_and_scale():
    """One thread and two give the same numbers; a given scale is used."""
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 900, 64), torch.randn(1, 2, 900, 64)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(cpu_decode.attention(q, k, v, 0.3))
    finally:
        torch.set_num_threads(before)
    want = reference(q, k, v, 0.3)
    assert all((o - want).abs().max() < 1e-5 for o in outs)
    assert (cpu_decode.attention(q, k, v, 0.125) - want).abs().max() > 1e-3


def test_exp_over_the_whole_range():
    """Scores far apart: probabilities from 1 down to below fp32's smallest (the kernel's own exp)."""
    H = 16
    k = torch.zeros(1, 1, 64, H)
    k[0, 0, :, 0] = -torch.linspace(0, 120, 64)  # scores 0 .. -120 with q = e_0
    v = torch.randn(1, 1, 64, H)
    q = torch.zeros(1, 1, 1, H)
    q[..., 0] = 1.0
    got = cpu_decode.attention(q, k, v, 1.0)
    want = reference(q, k, v, 1.0)
    assert (got - want).abs().max() < 1e-6


def test_chunks_rule():
    assert cpu_decode.chunks_for(rows=2, T=2000, threads=2) == 1  # a KV head per thread
    assert cpu_decode.chunks_for(rows=2, T=2000, threads=16) == 7  # 8 wanted, none under 256 positions
    assert cpu_decode.chunks_for(rows=1, T=2000, threads=4) == 4
    assert cpu_decode.chunks_for(rows=4, T=100, threads=16) == 1  # too short to split


def test_usable_rules(monkeypatch):
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    assert cpu_decode.usable(q, k, k)
    assert not cpu_decode.usable(q.double(), k.double(), k.double())  # fp32 only
    assert not cpu_decode.usable(q[..., :24], k[..., :24], k[..., :24])  # a head size it is not built for
    kt = torch.randn(1, 2, 64, 10).transpose(2, 3)  # rows not contiguous
    assert not cpu_decode.usable(q, kt, kt)
    monkeypatch.setattr(cpu_decode, "enabled", False)
    assert not cpu_decode.usable(q, k, k)


def test_compiled_session_runs_the_kernel_and_stays_right():
    """A compiled session's decode steps go through the kernel (the profiler sees the op), with
    the tokens of the full forward; a head size it is not built for keeps the library route."""
    model = tiny_model()  # head size 16
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    s = Session(model, compile=True)
    assert list(s.send(prompt, max_new_tokens=3, greedy=True)) == greedy_by_full_forward(model, prompt, 3)
    with torch.profiler.profile() as prof:
        more = list(s.send(None, max_new_tokens=4, greedy=True))
    assert more == greedy_by_full_forward(model, prompt, 7)[3:]
    calls = sum(e.count for e in prof.key_averages() if e.key == "glassformer::cpu_decode_attention")
    assert calls == 4 * model.config.n_layers

    odd = tiny_model(seed=1, dim=96, ffn_dim=256, n_layers=2)  # head size 24
    s = Session(odd, compile=True)
    with torch.profiler.profile() as prof:
        got = list(s.send(prompt, max_new_tokens=4, greedy=True))
    assert got == greedy_by_full_forward(odd, prompt, 4)
    assert not any(e.key == "glassformer::cpu_decode_attention" for e in prof.key_averages())


def test_a_compiler_that_fails_leaves_the_library_route(tmp_path):
    """No usable compiler: load() warns once, says why, and returns False; nothing is cached."""
    code = (
        "import warnings, torch\n"
        "from glassformer.attention import cpu_decode\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    ok = cpu_decode.load(); again = cpu_decode.load()\n"
        "print(ok, again, len(w), 'could not be built' in str(w[0].message))\n"
    )
    env = {"CXX": "false", "GLASSFORMER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["False", "False", "1", "True"], out.stderr
    assert not list(tmp_path.rglob("*.so"))


def test_built_once_per_source(tmp_path, monkeypatch):
    """The library goes to the cache folder, named by a hash of its source and build; a second
    build of the same source reuses it."""
    monkeypatch.setenv("GLASSFORMER_CACHE", str(tmp_path))
    cxx = cpu_decode._compiler()
    first = cpu_decode._build(cxx)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "kernels" and first.suffix == ".so"
    assert cpu_decode._build(cxx) == first and first.stat().st_mtime_ns == stamp


def test_tensors_it_does_not_fit_get_a_clear_error():
    """Called directly with tensors the kernel cannot read, it refuses rather than read past them."""
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    for args in ((q, k, k[:, :1]),  # keys and values of different lengths
                 (q, k.transpose(2, 3).contiguous().transpose(2, 3), k),  # key rows not contiguous
                 (q.double(), k.double(), k.double()),
                 (torch.randn(1, 4, 2, 64), k, k),  # two queries per row
                 (torch.randn(1, 3, 1, 64), k, k)):  # 3 query heads over 2 KV heads
        with pytest.raises(ValueError, match="cpu_decode: wants"):
            cpu_decode.attention(*args, 0.125)


@pytest.mark.parametrize("N,K,bias", [(2048, 384, False), (640, 384, True), (385, 100, True), (17, 33, False)])
def test_few_rows_product_equals_the_library(N, K, bias):
    """The kernel's few-row product over panels (the last zero-padded) against F.linear in float64: rows
    from 1 to 64 (every pass size and remainder), rows apart in memory and strided ones, a bias, one thread
    and two."""
    w = torch.randn(N, K)
    b = torch.randn(N) if bias else None
    p = cpu_decode.panels(w.t().contiguous(), b)
    assert p.n == N and p.w.shape[1] == K and p.w.shape[0] * p.w.shape[2] >= N
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 5, 6, 7, 13, 14, 15, 16, 33, 64):
                for x in (torch.randn(m, K), torch.randn(m, K + 3)[:, :K], torch.randn(m, 2 * K)[:, ::2]):
                    want = F.linear(x.double(), w.double(), None if b is None else b.double())
                    got = cpu_decode.few_rows_product(x, p)
                    assert got.shape == (m, N)
                    assert (got - want).abs().max() < 1e-5 * K, (threads, m, x.stride())
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="wants x"):
        cpu_decode.few_rows_product(torch.randn(2, K + 1), p)


def test_a_batched_step_multiplies_by_the_kernels_panels(monkeypatch):
    """Where the kernel is loaded, a batched decode step's few-row products read panels built at the first
    such product, with the logits of oneDNN's packed products (cpu_decode.products off, the copies rebuilt)."""
    import glassformer.model as M

    monkeypatch.setattr(M, "PACK_MIN", 0)  # the tiny model's weights are all small: pack them all
    model = tiny_model(seed=3)
    model.hold_rows()
    step = batched_step(model)
    panels = step()
    attn, ffn = model.blocks[0].attn, model.blocks[0].ffn
    assert all(isinstance(h[4], cpu_decode.Panels) for h in (attn.held, attn.wo.held, ffn.held, model.blocks[0].ffn.w_down.held))
    monkeypatch.setattr(cpu_decode, "products", False)
    model.hold_rows(False)
    model.hold_rows()
    onednn = step()
    assert not isinstance(attn.held[4], cpu_decode.Panels)
    torch.testing.assert_close(panels, onednn, atol=1e-5, rtol=0)
