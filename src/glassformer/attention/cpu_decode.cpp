// One decode step's attention on the CPU, for compiled sessions and for continuous batching's
// many-row steps, each row up to its own position, and those steps' few-row weight products (at
// the end of this file; attention/cpu_decode.py builds it).
//
// At one query per row a decode step's attention reads every cached key and value once and
// does almost no arithmetic per byte: it is bound by how fast a core streams memory. The
// library route (two small batched products and a softmax) streams ~10 GB/s a core, a
// third of what a core can, because a product with 3 rows (a KV head's group of queries)
// is a poor fit for a GEMM kernel. This kernel reads each key and value row once for the
// whole group, in one pass over the keys and one over the values, each thread on its own
// KV head (or stretch of positions), so a long context costs about what its bytes cost
// (docs/benchmarks.md, "Context growth").
//
// Written with GCC/Clang vector extensions, a vector as wide as the machine's own (16 floats
// with AVX-512, 8 with AVX2, 4 with NEON), so the compiler maps it to whatever the machine has;
// no intrinsics, no torch headers. How many query heads a pass serves, and how much of a row,
// follows from the machine's register count, so that nothing spills (bench/batching.py).
//
// Per work item (row b, KV head h, positions [t0, t1)) and query head g of the group:
//   s[t] = scale · q_g · k_t                 scores, 4 positions at a time
//   m = max_t s[t];  p[t] = exp(s[t] - m);  l = Σ_t p[t]
//   a = Σ_t p[t] · v_t                       unnormalised output
// and the items of one (b, h) are merged as in FlashAttention: out = Σ_i e^(m_i - M) a_i /
// Σ_i e^(m_i - M) l_i with M = max_i m_i.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if !(defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#error "needs __builtin_shufflevector (GCC 12+ or Clang)"
#endif

// The machine's own vector width and register count: -march=native says which. A vector type
// wider than the machine's is split by the compiler into several registers each, which is how
// 16-float vectors spilled on an AVX2 machine (16 registers of 8 floats).
#if defined(__AVX512F__)
#define GF_W 16
#define GF_REGS 32
#elif defined(__AVX__)
#define GF_W 8
#define GF_REGS 16
#elif defined(__aarch64__)
#define GF_W 4
#define GF_REGS 32
#else
#define GF_W 4
#define GF_REGS 16
#endif
constexpr int W = GF_W;        // floats a vector
constexpr int REGS = GF_REGS;  // vector registers
typedef float vf __attribute__((vector_size(4 * GF_W)));
typedef int32_t vi __attribute__((vector_size(4 * GF_W)));
typedef float v4 __attribute__((vector_size(16)));

static inline vf load(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
static inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
static inline vf splat(float x) { return x - vf{}; }  // x - 0 is x, -0 too: one broadcast (0 + x is not: an add first)
static inline vf pick(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline float lanes_max(vf x) { float m = x[0]; for (int i = 1; i < W; ++i) m = std::max(m, x[i]); return m; }
static inline float lanes_sum(vf x) { float s = 0.f; for (int i = 0; i < W; ++i) s += x[i]; return s; }

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n · P(r), n = round(x / ln 2),
// r = x - n ln 2 in [-ln2/2, ln2/2], P Cephes' degree-6 polynomial (~1 ulp over that range).
static inline vf exp_nonpositive(vf x) {
  x = pick(x < splat(-87.f), splat(-87.f), x);                  // below: 0 within fp32 anyway
  vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 · 2^23)
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;             // ln 2 in two parts: exact n · hi
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;      // 2^n as a float's exponent bits
  return p * (vf)e;
}

// Lane sums of 4 vectors (lane j of the result = Σ a[j]): halves of two vectors added
// together, until 4 lanes are left, rather than four separate horizontal sums.
typedef float v8 __attribute__((vector_size(32)));
static inline v4 sum4(const vf* a) {
#if GF_W == 16
  vf b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vf b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          __builtin_shufflevector(a[2], a[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vf c = __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  v8 d = __builtin_shufflevector(c, c, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(c, c, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
#elif GF_W == 8
  vf b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15);  // a0's halves summed, a1's
  vf b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(a[2], a[3], 4, 5, 6, 7, 12, 13, 14, 15);
  vf c = __builtin_shufflevector(b0, b1, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(b0, b1, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c, c, 0, 4, 2, 6) + __builtin_shufflevector(c, c, 1, 5, 3, 7);
#else
  vf b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 4, 5) + __builtin_shufflevector(a[0], a[1], 2, 3, 6, 7);
  vf b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 4, 5) + __builtin_shufflevector(a[2], a[3], 2, 3, 6, 7);
  return __builtin_shufflevector(b0, b1, 0, 2, 4, 6) + __builtin_shufflevector(b0, b1, 1, 3, 5, 7);
#endif
}

// How many query heads one pass over the keys or values serves: the most (at most 4) whose
// sums fit in the vector registers beside what else the pass holds there (`fixed` registers,
// `each` more per head), 0 where not even one does.
constexpr int heads_fitting(int fixed, int each) {
  return (REGS - fixed) / each > 4 ? 4 : (REGS - fixed) / each;
}

// s[g][0..n) = scale · q_g · k_t for GB query heads (rows of q, H apart; rows of s, `stride`
// apart) and the n rows of k (row length H = W·HC): each key row is loaded once for all GB.
// The queries are held in registers (with 4 rows' partial sums each and a key row: 4 spare).
template <int GB, int HC>
static void scores(const float* q, const float* k, int64_t n, float scale, float* s, int64_t stride) {
  constexpr int64_t H = W * HC;
  vf qc[GB][HC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < HC; ++c) qc[g][c] = load(q + g * H + W * c) * scale;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // 4 rows: a vector of partial sums per (row, head), then summed 4 at once
    vf a[GB][4];
    for (int j = 0; j < 4; ++j) {
      const float* kr = k + (t + j) * H;
      vf kc[HC];
      for (int c = 0; c < HC; ++c) kc[c] = load(kr + W * c);
      for (int g = 0; g < GB; ++g) {
        vf x = qc[g][0] * kc[0];
        for (int c = 1; c < HC; ++c) x += qc[g][c] * kc[c];
        a[g][j] = x;
      }
    }
    for (int g = 0; g < GB; ++g) {
      v4 r = sum4(a[g]);
      std::memcpy(s + g * stride + t, &r, sizeof r);
    }
  }
  for (; t < n; ++t) {  // the last n % 4 rows
    const float* kr = k + t * H;
    for (int g = 0; g < GB; ++g) {
      vf x = qc[g][0] * load(kr);
      for (int c = 1; c < HC; ++c) x += qc[g][c] * load(kr + W * c);
      s[g * stride + t] = lanes_sum(x);
    }
  }
}
constexpr int QUERIES_HELD(int HC) { return heads_fitting(4 + HC, HC + 4); }

// The same where the queries do not fit in the registers (a head of 64 floats is half of an AVX2
// machine's 16 registers): 4 key rows a vector at a time, each query vector read from the L1 cache.
template <int GB, int HC>
static void scores_streamed(const float* q, const float* k, int64_t n, float scale, float* s, int64_t stride) {
  constexpr int64_t H = W * HC;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    vf a[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = splat(0.f);
    for (int c = 0; c < HC; ++c) {
      vf kc[4];
      for (int j = 0; j < 4; ++j) kc[j] = load(k + (t + j) * H + W * c);
      for (int g = 0; g < GB; ++g) {
        const vf qg = load(q + g * H + W * c);
        for (int j = 0; j < 4; ++j) a[g][j] += qg * kc[j];
      }
    }
    for (int g = 0; g < GB; ++g) {
      v4 r = sum4(a[g]) * scale;
      std::memcpy(s + g * stride + t, &r, sizeof r);
    }
  }
  for (; t < n; ++t) {
    for (int g = 0; g < GB; ++g) {
      vf x = splat(0.f);
      for (int c = 0; c < HC; ++c) x += load(q + g * H + W * c) * load(k + t * H + W * c);
      s[g * stride + t] = lanes_sum(x) * scale;
    }
  }
}
constexpr int QUERIES_STREAMED = heads_fitting(4, 4);

// s[0..n) <- exp(s - max s); returns (max, sum of the exponentials).
static void softmax_unnormalised(float* s, int64_t n, float* m_out, float* l_out) {
  vf mv = splat(-INFINITY);
  int64_t t = 0;
  for (; t + W <= n; t += W) { vf x = load(s + t); mv = pick(x > mv, x, mv); }
  float m = lanes_max(mv);
  for (; t < n; ++t) m = std::max(m, s[t]);
  vf lv = splat(0.f);
  float l = 0.f;
  for (t = 0; t + W <= n; t += W) {
    vf e = exp_nonpositive(load(s + t) - m);
    store(s + t, e);
    lv += e;
  }
  for (; t < n; ++t) { s[t] = std::exp(s[t] - m); l += s[t]; }
  *m_out = m;
  *l_out = l + lanes_sum(lv);
}

// acc[g] = Σ_t p[g][t] · v_t for GB query heads at once (p rows `stride` apart), CB vectors of
// each value row at a time (the whole row where its sums fit in the registers): each value row
// is read from memory once for all of them, the GB·CB sums kept in registers.
template <int GB, int CB>
static void outputs(const float* p, int64_t stride, const float* v, int64_t H, int64_t n, float* acc) {
  for (int64_t c0 = 0; c0 < H; c0 += W * CB) {
    vf a[GB][CB];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CB; ++c) a[g][c] = splat(0.f);
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = v + t * H + c0;
      vf vc[CB];
      for (int c = 0; c < CB; ++c) vc[c] = load(vr + W * c);
      for (int g = 0; g < GB; ++g) {
        const vf pg = splat(p[g * stride + t]);
        for (int c = 0; c < CB; ++c) a[g][c] += pg * vc[c];
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CB; ++c) store(acc + g * H + c0 + W * c, a[g][c]);
  }
}
// The widest block of a value row (a power of two of vectors, at most the row) leaving room for 2 heads.
constexpr int columns_fitting(int HC) { return HC == 1 || heads_fitting(1 + HC, HC) >= 2 ? HC : columns_fitting(HC / 2); }

// The group's G query heads, `most` at a time.
template <int HC>
static void scores_groups(const float* q, const float* k, int64_t n, int64_t G, float scale, float* s) {
  constexpr int64_t H = W * HC;
  constexpr int held = QUERIES_HELD(HC);
  constexpr int most = held >= 1 ? held : QUERIES_STREAMED;
  for (int64_t g = 0; g < G;) {
    const int64_t gb = std::min<int64_t>(most, G - g);
    const float* qg = q + g * H;
    float* sg = s + g * n;
    if constexpr (held >= 1) {
      if (gb >= 4) scores<4, HC>(qg, k, n, scale, sg, n);
      else if (gb == 3) scores<3, HC>(qg, k, n, scale, sg, n);
      else if (gb == 2) scores<2, HC>(qg, k, n, scale, sg, n);
      else scores<1, HC>(qg, k, n, scale, sg, n);
    } else {
      if (gb >= 4) scores_streamed<4, HC>(qg, k, n, scale, sg, n);
      else if (gb == 3) scores_streamed<3, HC>(qg, k, n, scale, sg, n);
      else if (gb == 2) scores_streamed<2, HC>(qg, k, n, scale, sg, n);
      else scores_streamed<1, HC>(qg, k, n, scale, sg, n);
    }
    g += gb;
  }
}

template <int HC>
static void outputs_groups(const float* p, int64_t stride, const float* v, int64_t n, int64_t G, float* acc) {
  constexpr int64_t H = W * HC;
  constexpr int CB = columns_fitting(HC);
  constexpr int most = heads_fitting(1 + CB, CB) >= 1 ? heads_fitting(1 + CB, CB) : 1;
  for (int64_t g = 0; g < G;) {
    const int64_t gb = std::min<int64_t>(most, G - g);
    const float* pg = p + g * stride;
    float* ag = acc + g * H;
    if (gb >= 4) outputs<4, CB>(pg, stride, v, H, n, ag);
    else if (gb == 3) outputs<3, CB>(pg, stride, v, H, n, ag);
    else if (gb == 2) outputs<2, CB>(pg, stride, v, H, n, ag);
    else outputs<1, CB>(pg, stride, v, H, n, ag);
    g += gb;
  }
}

template <int HC>
static void item(const float* q, const float* k, const float* v, int64_t n, int64_t G, float scale,
                 float* s, float* part) {
  float* m = part;            // (G,) each query head's max score
  float* l = part + G;        // (G,) its sum of exponentials
  float* acc = part + 2 * G;  // (G, H) its unnormalised output
  scores_groups<HC>(q, k, n, G, scale, s);
  for (int64_t g = 0; g < G; ++g) softmax_unnormalised(s + g * n, n, m + g, l + g);
  outputs_groups<HC>(s, n, v, n, G, acc);
}

extern "C" int glassformer_decode_attention(
    const float* q, const float* k, const float* v, float* out,
    int64_t B, int64_t KH, int64_t G, int64_t H, int64_t T,
    int64_t k_bstride, int64_t k_hstride, int64_t v_bstride, int64_t v_hstride,
    float scale, int64_t threads, int64_t chunks, const int64_t* lens) {
  // q, out: (B, KH·G, H) contiguous; key row t of (b, h) at k + b·k_bstride + h·k_hstride + t·H (values alike).
  // lens: (B,) how many of the T keys row b reads (the first ones; a continuous-batching step's rows
  // stand at their own positions), or null: all T. A row that reads none gets zeros.
  if (H != 16 && H != 32 && H != 64 && H != 128) return 1;
  if (T < 1 || chunks < 1 || threads < 1) return 2;
  const int64_t len = (T + chunks - 1) / chunks;  // positions per item
  chunks = (T + len - 1) / len;
  const int64_t items = B * KH * chunks, part_size = G * (H + 2);
  std::vector<float> parts(items * part_size);
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
    std::vector<float> s(G * len);  // this thread's scores, then probabilities
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t bh = i / chunks, b = bh / KH, h = bh % KH;
      const int64_t Tb = lens == nullptr ? T : std::max<int64_t>(0, std::min(T, lens[b]));
      const int64_t t0 = (i % chunks) * len, n = std::min(Tb, t0 + len) - t0;
      float* part = parts.data() + i * part_size;
      if (n <= 0) {  // past this row's keys: nothing to add
        std::fill(part, part + G, -INFINITY);
        std::fill(part + G, part + part_size, 0.f);
        continue;
      }
      const float* kp = k + b * k_bstride + h * k_hstride + t0 * H;
      const float* vp = v + b * v_bstride + h * v_hstride + t0 * H;
      const float* qp = q + bh * G * H;
      switch (H / W) {
        case 1: item<1>(qp, kp, vp, n, G, scale, s.data(), part); break;
        case 2: item<2>(qp, kp, vp, n, G, scale, s.data(), part); break;
        case 4: item<4>(qp, kp, vp, n, G, scale, s.data(), part); break;
        case 8: item<8>(qp, kp, vp, n, G, scale, s.data(), part); break;
        case 16: item<16>(qp, kp, vp, n, G, scale, s.data(), part); break;
        default: item<32>(qp, kp, vp, n, G, scale, s.data(), part); break;  // H 128 at 4 floats a vector
      }
    }
  }
  for (int64_t bh = 0; bh < B * KH; ++bh) {  // merge each (b, h)'s stretches of positions
    for (int64_t g = 0; g < G; ++g) {
      float M = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) M = std::max(M, parts[(bh * chunks + c) * part_size + g]);
      float* o = out + (bh * G + g) * H;
      std::fill(o, o + H, 0.f);
      if (M == -INFINITY) continue;  // no key read: zeros
      float l = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = parts.data() + (bh * chunks + c) * part_size;
        const float w = std::exp(part[g] - M);
        l += w * part[G + g];
        const float* a = part + 2 * G + g * H;
        for (int64_t d = 0; d < H; ++d) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < H; ++d) o[d] /= l;
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// A decode step's weight products over a few rows (a continuous-batching step: 2 to 64 rows).
//
// y (M, N) = x (M, K) · Wᵀ + bias with W held as panels: ceil(N / NP) panels of (K, NP) floats,
// NP = 2 vectors of columns, each panel's columns contiguous a row of K at a time, the last panel
// zero-padded. A panel is streamed from memory once, on its first pass of R rows, and read from the
// L1/L2 cache on its other passes; panels follow one another in memory, so the step's weights
// stream as one sequence, which the library's packed product (oneDNN's) at a few rows, its weights
// in memory rather than in the caches, did not keep up (bench/few_rows.py, bench/batching.py
// --onednn-products).
// The R·2 sums of a pass stay in registers beside the panel's 2 vectors and the row's broadcast.
constexpr int NP = 2 * W;             // columns a panel
constexpr int RP = (REGS - 3) / 2;    // rows a pass: 6 with AVX2's 16 registers, 14 with 32

// A pass over a panel for RR rows; on the way it prefetches the cache lines of the next panel's rows
// pf..pf_end, one every `every` k (none where pf == pf_end).
template <int RR>
static void panel_rows(const float* x, int64_t ldx, int64_t K, const float* wp, const float* bias,
                       float* y, int64_t ldy, int64_t cols, const float* pf, const float* pf_end, int64_t every) {
  vf a[RR][2];
  const vf b0 = bias ? load(bias) : splat(0.f), b1 = bias ? load(bias + W) : splat(0.f);
  for (int r = 0; r < RR; ++r) { a[r][0] = b0; a[r][1] = b1; }
  int64_t wait = 1;
  for (int64_t k = 0; k < K; ++k) {
    const vf w0 = load(wp + k * NP), w1 = load(wp + k * NP + W);
    if (pf < pf_end && --wait == 0) {  // a row of the next panel: one cache line on AVX2, two on AVX-512
      for (int l = 0; l < NP * 4; l += 64) __builtin_prefetch((const char*)pf + l, 0, 2);
      pf += NP;
      wait = every;
    }
    for (int r = 0; r < RR; ++r) {
      const vf xb = splat(x[r * ldx + k]);
      a[r][0] += xb * w0;
      a[r][1] += xb * w1;
    }
  }
  for (int r = 0; r < RR; ++r) {
    float t[NP];
    store(t, a[r][0]);
    store(t + W, a[r][1]);
    std::memcpy(y + r * ldy, t, cols * sizeof(float));
  }
}

// panel_rows<rr> for a pass of rr rows, 1 <= rr <= RP (only those sizes are built).
template <int... Is>
static void rows_pass(std::integer_sequence<int, Is...>, int64_t rr, const float* x, int64_t ldx, int64_t K,
                      const float* wp, const float* bias, float* y, int64_t ldy, int64_t cols, const float* pf,
                      const float* pf_end, int64_t every) {
  (void)((rr == Is + 1 ? (panel_rows<Is + 1>(x, ldx, K, wp, bias, y, ldy, cols, pf, pf_end, every), true) : false) || ...);
}

// The passes over a panel after its first compute from the cache while the memory would idle: they
// fetch the next panel into L2 meanwhile, each its share of that panel's rows spread over its own
// k loop, so the next panel's first pass waits less. Only where the second pass is full, and only
// passes of at least half RP rows take a share: a shorter pass ends before its prefetches arrive,
// and crowding it was slower (measured against the other ways by hand; what this gives against
// oneDNN's product: bench/few_rows.py, docs/benchmarks.md).
static int64_t prefetching_passes(int64_t M) {
  const int64_t full = M / RP, rest = M % RP;
  return full < 2 ? 0 : full - 1 + (2 * rest >= RP);
}

extern "C" int glassformer_panel_width() { return NP; }

// x rows ldx apart; wp the panels; bias padded to the panels' columns (or null); y (M, N) contiguous.
extern "C" int glassformer_few_rows_product(const float* x, int64_t M, int64_t K, int64_t ldx, const float* wp,
                                            int64_t N, const float* bias, float* y, int64_t threads) {
  if (M < 1 || K < 1 || N < 1 || threads < 1) return 1;
  const int64_t P = (N + NP - 1) / NP;
  const int64_t helpers = prefetching_passes(M), share = helpers ? (K + helpers - 1) / helpers : 0;
#pragma omp parallel for num_threads(threads) if (threads > 1 && P > 1) schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float* w = wp + p * K * NP;
    const float* b = bias ? bias + p * NP : nullptr;
    const int64_t cols = std::min<int64_t>(NP, N - p * NP);
    for (int64_t r0 = 0; r0 < M; r0 += RP) {
      const int64_t rr = std::min<int64_t>(RP, M - r0);
      const int64_t j = r0 / RP - 1;  // this pass among those after the first (-1: the first)
      const float* next = w + K * NP;  // the next panel
      const float* pf = j >= 0 && j < helpers && p + 1 < P ? next + std::min(K, j * share) * NP : nullptr;
      const float* pf_end = pf ? next + std::min(K, (j + 1) * share) * NP : nullptr;
      rows_pass(std::make_integer_sequence<int, RP>{}, rr, x + r0 * ldx, ldx, K, w, b, y + r0 * N + p * NP, N, cols,
                pf, pf_end, helpers);
    }
  }
  return 0;
}
