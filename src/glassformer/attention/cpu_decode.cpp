// One decode step's attention on the CPU, for compiled sessions (attention/cpu_decode.py builds it).
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
// Written with GCC/Clang vector extensions (16 floats a vector), so the compiler maps it to
// whatever the machine has (AVX-512, AVX2, NEON); no intrinsics, no torch headers.
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
#include <vector>

#if !(defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#error "needs __builtin_shufflevector (GCC 12+ or Clang)"
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline v16 load(const float* p) { v16 x; std::memcpy(&x, p, sizeof x); return x; }
static inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
static inline v16 splat(float x) { return v16{} + x; }
static inline v16 pick(vi16 mask, v16 a, v16 b) { return (v16)((mask & (vi16)a) | (~mask & (vi16)b)); }
static inline float lanes_max(v16 x) { float m = x[0]; for (int i = 1; i < 16; ++i) m = std::max(m, x[i]); return m; }
static inline float lanes_sum(v16 x) { float s = 0.f; for (int i = 0; i < 16; ++i) s += x[i]; return s; }

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n · P(r), n = round(x / ln 2),
// r = x - n ln 2 in [-ln2/2, ln2/2], P Cephes' degree-6 polynomial (~1 ulp over that range).
static inline v16 exp_nonpositive(v16 x) {
  x = pick(x < splat(-87.f), splat(-87.f), x);                  // below: 0 within fp32 anyway
  v16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 · 2^23)
  v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;             // ln 2 in two parts: exact n · hi
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;      // 2^n as a float's exponent bits
  return p * (v16)e;
}

// Lane sums of 4 vectors (lane j of the result = Σ a[j]): halves of two vectors added
// together, twice, then within the vector, rather than four separate horizontal sums.
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
static inline v4 sum4(const v16* a) {
  v16 b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2], a[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 c = __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
          __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  v8 d = __builtin_shufflevector(c, c, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(c, c, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
}

// s[g][0..n) = scale · q_g · k_t for GB query heads (rows of q, H apart; rows of s, `stride`
// apart) and the n rows of k (row length H = 16·HC): each key row is loaded once for all GB.
template <int GB, int HC>
static void scores(const float* q, const float* k, int64_t n, float scale, float* s, int64_t stride) {
  constexpr int64_t H = 16 * HC;
  v16 qc[GB][HC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < HC; ++c) qc[g][c] = load(q + g * H + 16 * c) * scale;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // 4 rows: a vector of partial sums per (row, head), then summed 4 at once
    v16 a[GB][4];
    for (int j = 0; j < 4; ++j) {
      const float* kr = k + (t + j) * H;
      v16 kc[HC];
      for (int c = 0; c < HC; ++c) kc[c] = load(kr + 16 * c);
      for (int g = 0; g < GB; ++g) {
        v16 x = qc[g][0] * kc[0];
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
      v16 x = qc[g][0] * load(kr);
      for (int c = 1; c < HC; ++c) x += qc[g][c] * load(kr + 16 * c);
      s[g * stride + t] = lanes_sum(x);
    }
  }
}

// s[0..n) <- exp(s - max s); returns (max, sum of the exponentials).
static void softmax_unnormalised(float* s, int64_t n, float* m_out, float* l_out) {
  v16 mv = splat(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) { v16 x = load(s + t); mv = pick(x > mv, x, mv); }
  float m = lanes_max(mv);
  for (; t < n; ++t) m = std::max(m, s[t]);
  v16 lv = splat(0.f);
  float l = 0.f;
  for (t = 0; t + 16 <= n; t += 16) {
    v16 e = exp_nonpositive(load(s + t) - m);
    store(s + t, e);
    lv += e;
  }
  for (; t < n; ++t) { s[t] = std::exp(s[t] - m); l += s[t]; }
  *m_out = m;
  *l_out = l + lanes_sum(lv);
}

// acc[g] = Σ_t p[g][t] · v_t for GB query heads at once (p rows `stride` apart): each value
// row is read once for all of them, the GB·HC sums kept in registers.
template <int GB, int HC>
static void outputs(const float* p, int64_t stride, const float* v, int64_t n, float* acc) {
  constexpr int64_t H = 16 * HC;
  v16 a[GB][HC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < HC; ++c) a[g][c] = splat(0.f);
  for (int64_t t = 0; t < n; ++t) {
    const float* vr = v + t * H;
    v16 vc[HC];
    for (int c = 0; c < HC; ++c) vc[c] = load(vr + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const v16 pg = splat(p[g * stride + t]);
      for (int c = 0; c < HC; ++c) a[g][c] += pg * vc[c];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < HC; ++c) store(acc + g * H + 16 * c, a[g][c]);
}

// The group's G query heads, GB at a time (the most whose sums fit in the vector registers).
template <int HC>
static void scores_groups(const float* q, const float* k, int64_t n, int64_t G, float scale, float* s) {
  constexpr int64_t H = 16 * HC;
  constexpr int most = HC >= 8 ? 1 : HC >= 4 ? 3 : 4;
  for (int64_t g = 0; g < G;) {
    const int64_t gb = std::min<int64_t>(most, G - g);
    if (gb == 4) scores<4, HC>(q + g * H, k, n, scale, s + g * n, n);
    else if (gb == 3) scores<3, HC>(q + g * H, k, n, scale, s + g * n, n);
    else if (gb == 2) scores<2, HC>(q + g * H, k, n, scale, s + g * n, n);
    else scores<1, HC>(q + g * H, k, n, scale, s + g * n, n);
    g += gb;
  }
}

template <int HC>
static void outputs_groups(const float* p, int64_t stride, const float* v, int64_t n, int64_t G, float* acc) {
  constexpr int64_t H = 16 * HC;
  constexpr int most = HC >= 8 ? 2 : 4;
  for (int64_t g = 0; g < G;) {
    const int64_t gb = std::min<int64_t>(most, G - g);
    const float* pg = p + g * stride;
    float* ag = acc + g * H;
    if (gb == 4) outputs<4, HC>(pg, stride, v, n, ag);
    else if (gb == 3) outputs<3, HC>(pg, stride, v, n, ag);
    else if (gb == 2) outputs<2, HC>(pg, stride, v, n, ag);
    else outputs<1, HC>(pg, stride, v, n, ag);
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
    float scale, int64_t threads, int64_t chunks) {
  // q, out: (B, KH·G, H) contiguous; key row t of (b, h) at k + b·k_bstride + h·k_hstride + t·H (values alike).
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
      const int64_t t0 = (i % chunks) * len, n = std::min(T, t0 + len) - t0;
      const float* kp = k + b * k_bstride + h * k_hstride + t0 * H;
      const float* vp = v + b * v_bstride + h * v_hstride + t0 * H;
      const float* qp = q + bh * G * H;
      float* part = parts.data() + i * part_size;
      if (H == 16) item<1>(qp, kp, vp, n, G, scale, s.data(), part);
      else if (H == 32) item<2>(qp, kp, vp, n, G, scale, s.data(), part);
      else if (H == 64) item<4>(qp, kp, vp, n, G, scale, s.data(), part);
      else item<8>(qp, kp, vp, n, G, scale, s.data(), part);
    }
  }
  for (int64_t bh = 0; bh < B * KH; ++bh) {  // merge each (b, h)'s stretches of positions
    for (int64_t g = 0; g < G; ++g) {
      float M = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) M = std::max(M, parts[(bh * chunks + c) * part_size + g]);
      float l = 0.f;
      float* o = out + (bh * G + g) * H;
      std::fill(o, o + H, 0.f);
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
