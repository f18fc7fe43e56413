// CPU kernels for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
// The LM head's cross entropy over [c, V] blocks (train/loss_head.py, `_HeadBlocks`), where V is the
// vocabulary (151,936 rows for Qwen3) and the head's elementwise passes and its dW chain cost more than
// its matmuls.
//
// HeadLogSoftmax: y = (x - max) - log(sum exp(x - max)) over each row of x [c, V] (MindSpore's
//   LogSoftmax). One read pass for the max, one for the sum (the row stays in L2), one write.
// HeadGradInto: the head's whole backward for one block, from the forward's log-softmax:
//   G = exp(logp) - onehot(t)                           [c, V], never stored: made 64 columns at a time
//   acc += G^T @ (h * s)                                 the head's fp32 dW accumulator [V, D], in place
//   dh = (G @ W) * s                                     the output [c, D]
//   Inputs: logp [c, V], t [c] (target ids as float32, exact below 2^24), h [c, D], s [c] (the row
//   scale, 0 for IGNORE), W [V, D], acc [V, D]. Rows with s = 0 get dh = 0 and add nothing (they
//   would add G * 0). Replaces Exp, TensorScatterSub, the dh MatMul and the row blocks of MatMul +
//   ScatterAdd (train/row_grads.py), with no [c, V] or [rows, D] temporary.
//
// Not bitwise equal to the composite ops (tests/train/test_head_kernel.py checks them against float64
// numpy and the composite path to float32 rounding): exp is a polynomial (Cephes expf, within 2 ulp),
// the log-softmax's sum of exponentials is kept in double, and both products are register-blocked sums
// whose order differs from MindSpore's MatMul (dW: per 256 rows of h, then added into acc; dh: per 64
// vocabulary rows, per thread, the two threads' halves added last). The results do not depend on the
// run (fixed split, fixed order), so two runs are bitwise equal.
//
// Vectorised with AVX-512 or AVX2 + FMA (whichever -march=native offers; scalar otherwise). Two threads
// (std::thread, as fused_adamw.cc) on large blocks: rows of x split in two for the log-softmax, the
// vocabulary split in two for the backward (each thread its own dh, added in order at the end).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

extern "C" std::vector<int64_t> HeadLogSoftmaxInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" TypeId HeadLogSoftmaxInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

// dh has the shape of h (input 2)
extern "C" std::vector<int64_t> HeadGradIntoInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[2], shapes[2] + ndims[2]);
}

extern "C" TypeId HeadGradIntoInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

namespace {

// ---- a vector of kLanes floats: the same kernels over AVX-512, AVX2 or one float ----
#if defined(__AVX512F__)
constexpr int kLanes = 16, kVecs = 4;  // vectors per row of a register tile: up to 6 x 4 accumulators
using Vec = __m512;
inline Vec Load(const float *p) { return _mm512_loadu_ps(p); }
inline void Store(float *p, Vec a) { _mm512_storeu_ps(p, a); }
inline void StoreStream(float *p, Vec a) { _mm512_stream_ps(p, a); }  // p 64-byte aligned, past the caches
inline Vec Set1(float a) { return _mm512_set1_ps(a); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float HMax(Vec a) { return _mm512_reduce_max_ps(a); }
inline float First(Vec a) { return _mm512_cvtss_f32(a); }
struct DSum {  // a running sum of vectors, in double
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  void Add(Vec a) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
  }
  double Total() const { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};
// 2^n * p for integral n (n below -149 gives 0)
inline Vec Scale2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }
inline Vec Round(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
constexpr float kExpLow = -103.972077f;  // exp of less is 0 in float32
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8, kVecs = 2;  // 16 ymm registers: up to 6 x 2 accumulators
using Vec = __m256;
inline Vec Load(const float *p) { return _mm256_loadu_ps(p); }
inline void Store(float *p, Vec a) { _mm256_storeu_ps(p, a); }
inline void StoreStream(float *p, Vec a) { _mm256_stream_ps(p, a); }  // p 32-byte aligned, past the caches
inline Vec Set1(float a) { return _mm256_set1_ps(a); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float HMax(Vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float First(Vec a) { return _mm256_cvtss_f32(a); }
struct DSum {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  void Add(Vec a) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
  }
  double Total() const {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(lo, hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};
// 2^n * p by the exponent bits: valid for n >= -126, so exp below kExpLow (2^-126) is flushed to 0 by Exp
inline Vec Scale2(Vec p, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline Vec Round(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
constexpr float kExpLow = -87.3365479f;
#else
constexpr int kLanes = 1, kVecs = 4;
using Vec = float;
inline Vec Load(const float *p) { return *p; }
inline void Store(float *p, Vec a) { *p = a; }
inline void StoreStream(float *p, Vec a) { *p = a; }
inline Vec Set1(float a) { return a; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline Vec Sub(Vec a, Vec b) { return a - b; }
inline Vec Fma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }
inline Vec Max(Vec a, Vec b) { return a > b ? a : b; }
inline float HMax(Vec a) { return a; }
inline float First(Vec a) { return a; }
struct DSum {
  double s = 0.0;
  void Add(Vec a) { s += a; }
  double Total() const { return s; }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp(x), Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, times 2^n. NaN stays
// NaN (min/max return their second operand when one is NaN).
inline Vec Exp(Vec x) {
#if defined(__AVX512F__)
  x = _mm512_max_ps(Set1(kExpLow), _mm512_min_ps(Set1(88.3762626f), x));
#else
  const Vec below = _mm256_cmp_ps(x, Set1(kExpLow), _CMP_LT_OQ);
  x = _mm256_max_ps(Set1(kExpLow), _mm256_min_ps(Set1(88.3762626f), x));
#endif
  const Vec n = Round(Mul(x, Set1(1.44269504088896341f)));
  Vec r = Fma(n, Set1(-0.693359375f), x);
  r = Fma(n, Set1(2.12194440e-4f), r);
  Vec p = Set1(1.9875691500e-4f);
  p = Fma(p, r, Set1(1.3981999507e-3f));
  p = Fma(p, r, Set1(8.3334519073e-3f));
  p = Fma(p, r, Set1(4.1665795894e-2f));
  p = Fma(p, r, Set1(1.6666665459e-1f));
  p = Fma(p, r, Set1(5.0000001201e-1f));
#if defined(__AVX512F__)
  p = Fma(p, Mul(r, r), Add(r, Set1(1.0f)));
  return Scale2(p, n);
#else
  p = Fma(p, Mul(r, r), Add(r, Set1(1.0f)));
  return _mm256_andnot_ps(below, Scale2(p, n));
#endif
}
#else
inline Vec Exp(Vec x) { return std::exp(x); }
#endif

inline float ExpOne(float x) { return First(Exp(Set1(x))); }  // the tails: the same function as the vectors

int64_t Elements(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

constexpr int64_t kThreadWork = 1 << 18;  // elements (log-softmax) or multiply-adds / D (backward) for 2 threads

// ---- HeadLogSoftmax ----
void LogSoftmaxRows(const float *x, float *y, int64_t v, int64_t r0, int64_t r1) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = r0; r < r1; ++r) {
    const float *xr = x + r * v;
    float *yr = y + r * v;
    Vec m4[4] = {Set1(-inf), Set1(-inf), Set1(-inf), Set1(-inf)};
    int64_t i = 0;
    for (; i + 4 * kLanes <= v; i += 4 * kLanes)
      for (int k = 0; k < 4; ++k) m4[k] = Max(Load(xr + i + k * kLanes), m4[k]);
    float mx = HMax(Max(Max(m4[0], m4[1]), Max(m4[2], m4[3])));
    for (; i < v; ++i) mx = std::max(mx, xr[i]);
    const Vec top = Set1(mx);
    DSum sum;
    double tail = 0.0;
    for (i = 0; i + kLanes <= v; i += kLanes) sum.Add(Exp(Sub(Load(xr + i), top)));
    for (; i < v; ++i) tail += ExpOne(xr[i] - mx);
    const float ls = static_cast<float>(std::log(sum.Total() + tail));
    const Vec lsv = Set1(ls);
    for (i = 0; i < v && reinterpret_cast<uintptr_t>(yr + i) % sizeof(Vec) != 0; ++i) yr[i] = (xr[i] - mx) - ls;
    for (; i + kLanes <= v; i += kLanes) StoreStream(yr + i, Sub(Sub(Load(xr + i), top), lsv));
    for (; i < v; ++i) yr[i] = (xr[i] - mx) - ls;
  }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  _mm_sfence();  // the streamed stores are visible before the kernel returns
#endif
}

}  // namespace

extern "C" int HeadLogSoftmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 2 || ndims[0] < 1) return 1;
  const int64_t v = shapes[0][ndims[0] - 1];
  const int64_t rows = v > 0 ? Elements(ndims[0], shapes[0]) / v : 0;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  if (rows < 2 || rows * v < kThreadWork) {
    LogSoftmaxRows(x, y, v, 0, rows);
  } else {
    std::thread other(LogSoftmaxRows, x, y, v, rows / 2, rows);
    LogSoftmaxRows(x, y, v, 0, rows / 2);
    other.join();
  }
  return 0;
}

namespace {

// ---- HeadGradInto ----
constexpr int64_t kTileV = 64;   // vocabulary rows per G tile (a 256-byte segment of each logp row)
constexpr int64_t kTileA = 256;  // rows of h per G tile
constexpr int64_t kW = kVecs * kLanes;  // columns of a register tile

// A [k, D] matrix as panels of kW columns, each panel [k, kW] contiguous (zero past D): a tile's operand
// rows are then read in sequence, not 4 * D bytes apart (which maps them onto few cache sets).
void Pack(const float *b, int64_t ldb, int64_t k, int64_t D, float *out) {
  for (int64_t q = 0; q * kW < D; ++q) {
    const int64_t width = std::min(kW, D - q * kW);
    for (int64_t i = 0; i < k; ++i) {
      float *o = out + (q * k + i) * kW;
      std::copy(b + i * ldb + q * kW, b + i * ldb + q * kW + width, o);
      std::fill(o + width, o + kW, 0.0f);
    }
  }
}

// out[r * ldo + d] += sum over k < kk of a[r * ars + k * aks] * panel[k * kW + d], for r < R, d < width: R rows
// of out in registers (kVecs vectors), summed from zero over k, then added into out.
template <int R>
void Tile(float *out, int64_t ldo, const float *a, int64_t ars, int64_t aks, const float *panel, int64_t kk,
          int64_t width) {
  Vec c[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kVecs; ++i) c[r][i] = Set1(0.0f);
  for (int64_t k = 0; k < kk; ++k) {
    Vec bv[kVecs];
    for (int i = 0; i < kVecs; ++i) bv[i] = Load(panel + k * kW + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec s = Set1(a[r * ars + k * aks]);
      for (int i = 0; i < kVecs; ++i) c[r][i] = Fma(s, bv[i], c[r][i]);
    }
  }
  if (width == kW) {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kVecs; ++i) {
        float *o = out + r * ldo + i * kLanes;
        Store(o, Add(Load(o), c[r][i]));
      }
    return;
  }
  float part[kW];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < kVecs; ++i) Store(part + i * kLanes, c[r][i]);
    for (int64_t d = 0; d < width; ++d) out[r * ldo + d] += part[d];
  }
}

// out [n, D] (row stride ldo) += A [n, kk] @ B [kk, D], B packed (`Pack`); A's element (r, k) at
// a[r * ars + k * aks]. Rows 6 at a time (6 x kVecs accumulators), for each panel.
void Product(int64_t n, float *out, int64_t ldo, const float *a, int64_t ars, int64_t aks, const float *packed,
             int64_t panel_rows, int64_t kk, int64_t D) {
  for (int64_t q = 0; q * kW < D; ++q) {
    const float *panel = packed + q * panel_rows * kW;
    const int64_t width = std::min(kW, D - q * kW);
    float *o = out + q * kW;
    int64_t r = 0;
    for (; r + 6 <= n; r += 6) Tile<6>(o + r * ldo, ldo, a + r * ars, ars, aks, panel, kk, width);
    switch (n - r) {
      case 5: Tile<5>(o + r * ldo, ldo, a + r * ars, ars, aks, panel, kk, width); break;
      case 4: Tile<4>(o + r * ldo, ldo, a + r * ars, ars, aks, panel, kk, width); break;
      case 3: Tile<3>(o + r * ldo, ldo, a + r * ars, ars, aks, panel, kk, width); break;
      case 2: Tile<2>(o + r * ldo, ldo, a + r * ars, ars, aks, panel, kk, width); break;
      case 1: Tile<1>(o + r * ldo, ldo, a + r * ars, ars, aks, panel, kk, width); break;
      default: break;
    }
  }
}

struct Grad {
  const float *logp, *hs_packed, *w;  // hs_packed: the active rows of h * s [A, D], packed
  const int64_t *row, *tgt;            // per active row: its row in logp, its target
  float *acc;
  int64_t n_active, v, d;
};

// G[a0 : a0 + na, v0 : v0 + vt] = exp(logp) - onehot(t) into tile (row stride kTileV)
void GradTile(const Grad &g, int64_t a0, int64_t na, int64_t v0, int64_t vt, int64_t v_end, float *tile) {
  for (int64_t a = 0; a < na; ++a) {
    const float *src = g.logp + g.row[a0 + a] * g.v + v0;
    float *dst = tile + a * kTileV;
    int64_t j = 0;
    for (; j + kLanes <= vt; j += kLanes) Store(dst + j, Exp(Load(src + j)));
    for (; j < vt; ++j) dst[j] = ExpOne(src[j]);
    const int64_t t = g.tgt[a0 + a] - v0;
    if (t >= 0 && t < vt) dst[t] -= 1.0f;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (v0 + vt + kTileV <= v_end)  // the next tile's segment of this row
      for (int64_t q = 0; q < kTileV; q += 16)
        _mm_prefetch(reinterpret_cast<const char *>(src + kTileV + q), _MM_HINT_T0);
#endif
  }
}

// The vocabulary rows [v_begin, v_end): acc's rows there, and this range's share of dh [A, D] (zeroed).
void GradRange(const Grad &g, int64_t v_begin, int64_t v_end, float *dh) {
  const int64_t D = g.d, A = g.n_active, padded = (D + kW - 1) / kW * kW;
  std::vector<float> tile(std::min(kTileA, A) * kTileV), w_packed(D == kW ? 0 : kTileV * padded);
  for (int64_t v0 = v_begin; v0 < v_end; v0 += kTileV) {
    const int64_t vt = std::min(kTileV, v_end - v0);
    const float *w_tile = g.w + v0 * D;  // already in panel form when D is one panel wide
    if (D != kW) {
      Pack(w_tile, D, vt, D, w_packed.data());
      w_tile = w_packed.data();
    }
    for (int64_t a0 = 0; a0 < A; a0 += kTileA) {
      const int64_t na = std::min(kTileA, A - a0);
      GradTile(g, a0, na, v0, vt, v_end, tile.data());
      // acc[v0 + j] += sum over a of G[a, j] hs[a0 + a]
      Product(vt, g.acc + v0 * D, D, tile.data(), 1, kTileV, g.hs_packed + a0 * kW, A, na, D);
      // dh[a0 + a] += sum over j of G[a, j] W[v0 + j]
      Product(na, dh + a0 * D, D, tile.data(), kTileV, 1, w_tile, vt, vt, D);
    }
  }
}

}  // namespace

extern "C" int HeadGradInto(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 7 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || ndims[3] != 1 || ndims[4] != 2 ||
      ndims[5] != 2)
    return 1;
  const int64_t c = shapes[0][0], V = shapes[0][1], D = shapes[2][1];
  if (shapes[1][0] != c || shapes[2][0] != c || shapes[3][0] != c || shapes[4][0] != V || shapes[4][1] != D ||
      shapes[5][0] != V || shapes[5][1] != D || V >= (int64_t{1} << 24))
    return 1;
  const float *logp = static_cast<const float *>(params[0]), *t = static_cast<const float *>(params[1]);
  const float *h = static_cast<const float *>(params[2]), *s = static_cast<const float *>(params[3]);
  float *dh = static_cast<float *>(params[6]);
  std::vector<int64_t> row, tgt;
  std::vector<float> hs, hs_packed;
  for (int64_t k = 0; k < c; ++k) {  // the rows that contribute (s != 0), h * s rounded as the Mul kernel
    if (s[k] == 0.0f) continue;
    row.push_back(k);
    tgt.push_back(static_cast<int64_t>(t[k]));
    for (int64_t i = 0; i < D; ++i) hs.push_back(h[k * D + i] * s[k]);
  }
  const int64_t A = static_cast<int64_t>(row.size());
  std::fill(dh, dh + c * D, 0.0f);
  if (A == 0 || V == 0) return 0;
  hs_packed.resize(A * ((D + kW - 1) / kW * kW));
  Pack(hs.data(), D, A, D, hs_packed.data());
  const Grad g{logp, hs_packed.data(), static_cast<const float *>(params[4]), row.data(), tgt.data(),
               static_cast<float *>(params[5]), A, V, D};
  std::vector<float> part(2 * A * D, 0.0f);
  const int64_t mid = std::min(V, (V / 2 + kTileV - 1) / kTileV * kTileV);
  if (A * V < kThreadWork || mid == V) {
    GradRange(g, 0, V, part.data());
  } else {  // two halves of the vocabulary, one per thread
    std::thread other(GradRange, std::cref(g), mid, V, part.data() + A * D);
    GradRange(g, 0, mid, part.data());
    other.join();
  }
  for (int64_t a = 0; a < A; ++a) {
    const float *p0 = part.data() + a * D, *p1 = p0 + A * D;
    float *out = dh + row[a] * D;
    for (int64_t i = 0; i < D; ++i) out[i] = (p0[i] + p1[i]) * s[row[a]];
  }
  return 0;
}
