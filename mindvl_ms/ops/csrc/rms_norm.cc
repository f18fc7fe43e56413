// CPU kernels for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
//
// RmsNorm: y = w * (x * r), r = 1 / sqrt(mean(x * x) + eps) over the last axis of x [..., D]; w [D]; eps [1].
//   One pass per row instead of MindSpore's Mul, ReduceMean, Add, Rsqrt, Mul, Mul kernels (and, under
//   dynamic shapes, two BroadcastTo kernels). Rounded as those kernels round: the squares summed as
//   MindSpore's CPU ReduceMean sums them (`inv_rms`), the sum divided by D, and 1 / sqrtf (its Rsqrt);
//   built with -ffp-contract=off, so the forward equals the composite ops bit for bit
//   (tests/test_cpu_kernels.py).
// RmsNormGradX: dx = r * g - x * (r^3 / D) * sum(g * x), g = dy * w (the analytic gradient; the composite
//   path's autodiff adds the same terms in another order, so the two agree to float32 rounding).
// RmsNormGradW: dw = sum over rows of dy * (x * r), rows added in order in double precision.
// Single-threaded, as qkv_rope.cc: memory-bound, and an OpenMP pool next to MindSpore's threads busy-waits.
#include <cmath>
#include <cstdint>
#include <vector>

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

extern "C" std::vector<int64_t> RmsNormInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" std::vector<int64_t> RmsNormGradXInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

// dw has the shape of w, the last axis of dy (unknown, -1, while dy's rank or last axis is)
extern "C" std::vector<int64_t> RmsNormGradWInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  const int64_t d = ndims[0] >= 1 ? shapes[0][ndims[0] - 1] : -1;
  return std::vector<int64_t>{d < 0 ? -1 : d};
}

extern "C" TypeId RmsNormInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId RmsNormGradXInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId RmsNormGradWInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

namespace {
struct Rows {
  int64_t rows, d;
};

Rows rows_of(int ndim, const int64_t *shape) {
  Rows r{1, ndim >= 1 ? shape[ndim - 1] : 1};
  for (int i = 0; i + 1 < ndim; ++i) r.rows *= shape[i];
  return r;
}

// 1 / sqrt(mean(x * x) + eps), the squares summed as MindSpore's CPU ReduceMean sums them over the last axis:
// of a 2-D tensor in 8 float lanes (lanes then added in order, the tail after them); of a higher-rank
// tensor in double precision, rounded to float once. `wide` selects the second.
float inv_rms(const float *x, int64_t d, float eps, bool wide) {
  float sum = 0.f;
  if (wide) {
    double acc = 0.0;
    for (int64_t i = 0; i < d; ++i) {
      const float sq = x[i] * x[i];
      acc += static_cast<double>(sq);
    }
    sum = static_cast<float>(acc);
  } else {
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const int64_t body = d / 8 * 8;
    for (int64_t i = 0; i < body; i += 8) {
      for (int l = 0; l < 8; ++l) {
        const float sq = x[i + l] * x[i + l];
        lane[l] += sq;
      }
    }
    for (int l = 0; l < 8; ++l) sum += lane[l];
    for (int64_t i = body; i < d; ++i) {
      const float sq = x[i] * x[i];
      sum += sq;
    }
  }
  const float mean = sum / static_cast<float>(d);
  return 1.f / std::sqrt(mean + eps);
}
}  // namespace

extern "C" int RmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  if (nparam != 4) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  const Rows s = rows_of(ndims[0], shapes[0]);
  for (int64_t i = 0; i < s.rows; ++i) {
    const float *xi = x + i * s.d;
    float *yi = y + i * s.d;
    const float r = inv_rms(xi, s.d, eps, ndims[0] > 2);
    for (int64_t j = 0; j < s.d; ++j) {
      const float xn = xi[j] * r;
      yi[j] = w[j] * xn;
    }
  }
  return 0;
}

extern "C" int RmsNormGradX(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 5) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *x = static_cast<const float *>(params[1]);
  const float *w = static_cast<const float *>(params[2]);
  const float eps = *static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  const Rows s = rows_of(ndims[0], shapes[0]);
  for (int64_t i = 0; i < s.rows; ++i) {
    const float *xi = x + i * s.d;
    const float *gi = dy + i * s.d;
    float *out = dx + i * s.d;
    const float r = inv_rms(xi, s.d, eps, ndims[0] > 2);
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const int64_t body = s.d / 8 * 8;
    for (int64_t j = 0; j < body; j += 8) {
      for (int l = 0; l < 8; ++l) lane[l] += gi[j + l] * w[j + l] * xi[j + l];
    }
    float dot = 0.f;  // sum(g * x)
    for (int l = 0; l < 8; ++l) dot += lane[l];
    for (int64_t j = body; j < s.d; ++j) dot += gi[j] * w[j] * xi[j];
    const float coef = r * r * r * dot / static_cast<float>(s.d);
    for (int64_t j = 0; j < s.d; ++j) out[j] = r * (gi[j] * w[j]) - xi[j] * coef;
  }
  return 0;
}

extern "C" int RmsNormGradW(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 4) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *x = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *dw = static_cast<float *>(params[3]);
  const Rows s = rows_of(ndims[0], shapes[0]);
  std::vector<double> acc(s.d, 0.0);
  for (int64_t i = 0; i < s.rows; ++i) {
    const float *xi = x + i * s.d;
    const float *gi = dy + i * s.d;
    const float r = inv_rms(xi, s.d, eps, ndims[0] > 2);
    for (int64_t j = 0; j < s.d; ++j) acc[j] += static_cast<double>(gi[j] * (xi[j] * r));
  }
  for (int64_t j = 0; j < s.d; ++j) dw[j] = static_cast<float>(acc[j]);
  return 0;
}
