// CPU kernel for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
//
// FusedAdamW: one parameter's whole optimizer update in one pass over its four tensors, in place
// (train/optim.py AdamWUpdate):
//   g = acc * mult                                   (the accumulated gradient, unscaled and clipped)
//   m = m + (g - m) (1 - b1);   v = v + (g^2 - v) (1 - b2)
//   p = p - lr coef (m / (sqrt(v) + eps) + wd wd_on p)
//   acc = 0
// Inputs: param, m, v, acc (one shape; written in place), then the scalars mult, lr, coef, b1, b2, eps, wd,
// wd_on ([] each); the output is a [1] zero the update graph depends on. Every operation rounds as the
// unfused update rounds it: acc * mult as MindSpore's Mul kernel, lr * coef and wd * wd_on as its scalar
// Muls, and the moments and the parameter as its AdamWeightDecay CPU kernel (multiply-adds fused in the
// moments, the step m / (sqrt(v) + eps) + wd p taken in double and rounded once into p), so the parameters,
// moments and accumulators are bitwise those of the Mul, Assign, AdamWeightDecay, ApplyGradientDescent
// chain (tests/train/test_fused_adamw.py), which passed over the accumulator four times.
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

extern "C" std::vector<int64_t> FusedAdamWInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>{1};
}

extern "C" TypeId FusedAdamWInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

struct Scalars {
  float mult, lr, b1, b2, eps, wd;  // lr = lr * coef, wd = wd * wd_on
};

const int64_t kSplit = 1 << 20;  // elements from which the update runs on two threads

static inline void UpdateOne(float *p, float *m, float *v, float *acc, const Scalars &s, int64_t i) {
  const float b1m = 1.0f - s.b1, b2m = 1.0f - s.b2;
  const float g = acc[i] * s.mult;
  const float mi = std::fma(g - m[i], b1m, m[i]);
  const float vi = std::fma(std::fma(g, g, -v[i]), b2m, v[i]);
  double u = static_cast<double>(mi) / (std::sqrt(static_cast<double>(vi)) + static_cast<double>(s.eps));
  u = u + static_cast<double>(s.wd * p[i]);
  p[i] = static_cast<float>(static_cast<double>(p[i]) - static_cast<double>(s.lr) * u);
  m[i] = mi;
  v[i] = vi;
  acc[i] = 0.0f;
}

// Elements [begin, end): 8 at a time with AVX2 + FMA (each lane rounds as UpdateOne: IEEE operations are
// exactly rounded whatever the width), the rest one by one.
static void Update(float *p, float *m, float *v, float *acc, const Scalars s, int64_t begin, int64_t end) {
  int64_t i = begin;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mult = _mm256_set1_ps(s.mult), b1m = _mm256_set1_ps(1.0f - s.b1), b2m = _mm256_set1_ps(1.0f - s.b2);
  const __m256 wd = _mm256_set1_ps(s.wd), zero = _mm256_setzero_ps();
  const __m256d eps = _mm256_set1_pd(s.eps), lr = _mm256_set1_pd(s.lr);
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(acc + i), mult);
    const __m256 m0 = _mm256_loadu_ps(m + i), v0 = _mm256_loadu_ps(v + i), p0 = _mm256_loadu_ps(p + i);
    const __m256 mi = _mm256_fmadd_ps(_mm256_sub_ps(g, m0), b1m, m0);
    const __m256 vi = _mm256_fmadd_ps(_mm256_fmsub_ps(g, g, v0), b2m, v0);
    const __m256 dp = _mm256_mul_ps(wd, p0);
    __m128 out[2];
    for (int h = 0; h < 2; ++h) {  // lanes 0-3, then 4-7, in double
      const __m128 mh = h ? _mm256_extractf128_ps(mi, 1) : _mm256_castps256_ps128(mi);
      const __m128 vh = h ? _mm256_extractf128_ps(vi, 1) : _mm256_castps256_ps128(vi);
      const __m128 dh = h ? _mm256_extractf128_ps(dp, 1) : _mm256_castps256_ps128(dp);
      const __m128 ph = h ? _mm256_extractf128_ps(p0, 1) : _mm256_castps256_ps128(p0);
      __m256d u = _mm256_div_pd(_mm256_cvtps_pd(mh), _mm256_add_pd(_mm256_sqrt_pd(_mm256_cvtps_pd(vh)), eps));
      u = _mm256_add_pd(u, _mm256_cvtps_pd(dh));
      out[h] = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_cvtps_pd(ph), _mm256_mul_pd(lr, u)));
    }
    _mm256_storeu_ps(p + i, _mm256_set_m128(out[1], out[0]));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(acc + i, zero);
  }
#endif
  for (; i < end; ++i) UpdateOne(p, m, v, acc, s, i);
}

extern "C" int FusedAdamW(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  if (nparam != 13) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  for (int k = 1; k < 4; ++k) {  // m, v and acc have the parameter's shape
    int64_t nk = 1;
    for (int i = 0; i < ndims[k]; ++i) nk *= shapes[k][i];
    if (nk != n) return 1;
  }
  float *p = static_cast<float *>(params[0]);
  float *m = static_cast<float *>(params[1]);
  float *v = static_cast<float *>(params[2]);
  float *acc = static_cast<float *>(params[3]);
  auto scalar = [&](int i) { return *static_cast<const float *>(params[i]); };
  const Scalars s{scalar(4), scalar(5) * scalar(6), scalar(7), scalar(8), scalar(9), scalar(10) * scalar(11)};
  if (n < kSplit) {
    Update(p, m, v, acc, s, 0, n);
  } else {  // two halves on two threads (the update is bound by the double sqrt and division)
    std::thread other(Update, p, m, v, acc, s, n / 2, n);
    Update(p, m, v, acc, s, 0, n / 2);
    other.join();
  }
  *static_cast<float *>(params[12]) = 0.0f;
  return 0;
}
