// CPU kernels for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
//
// RotaryHalf: out = x * c + rotate_half(x) * s, rotate_half(x) = [-x2, x1] over the last axis, for x
//   [B, N, S, D] and c, s [Bc, Nc, Sc, D] broadcast to x (each of Bc, Nc, Sc is 1 or x's size; the LLM
//   passes [B, 1, S, D]). One pass instead of MindSpore's Split, Neg, Concat, two BroadcastTo (dynamic
//   shapes), two Mul and Add kernels; every float op rounds as those kernels round it (built with
//   -ffp-contract=off), so the result equals theirs bit for bit (tests/test_cpu_rotary.py).
// RotaryHalfGrad: dx = dout * c + rotate_half^T(dout * s), rotate_half^T(y) = [y2, -y1]: autodiff's gradient
//   of the composite ops, bit for bit. (c and s get no gradient: they come from position ids.)
// Single-threaded, as qkv_rope.cc.
#include <cstdint>
#include <vector>

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

extern "C" std::vector<int64_t> RotaryHalfInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" std::vector<int64_t> RotaryHalfGradInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" TypeId RotaryHalfInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId RotaryHalfGradInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

namespace {
// element strides of the [Bc, Nc, Sc, D] tables over x's [B, N, S] rows: 0 along a broadcast axis
struct Table {
  int64_t b, n, s;
};

bool table_strides(int *ndims, int64_t **shapes, int t, Table *out) {
  if (ndims[0] != 4 || ndims[t] != 4) return false;
  const int64_t *x = shapes[0], *c = shapes[t];
  if (c[3] != x[3] || x[3] % 2) return false;
  for (int i = 0; i < 3; ++i) {
    if (c[i] != 1 && c[i] != x[i]) return false;
  }
  out->s = c[2] == 1 ? 0 : x[3];
  out->n = c[1] == 1 ? 0 : c[2] * x[3];
  out->b = c[0] == 1 ? 0 : c[1] * c[2] * x[3];
  return true;
}

// f(row of x / dout, row of c, row of s, row of the output, half) over every [b, n, s] row
template <typename F>
int for_rows(int *ndims, int64_t **shapes, void **params, F f) {
  Table t;
  if (!table_strides(ndims, shapes, 1, &t)) return 1;
  const int64_t *x = shapes[0];
  const int64_t d = x[3];
  const float *in = static_cast<const float *>(params[0]);
  const float *c = static_cast<const float *>(params[1]);
  const float *s = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  int64_t row = 0;
  for (int64_t b = 0; b < x[0]; ++b) {
    for (int64_t n = 0; n < x[1]; ++n) {
      for (int64_t q = 0; q < x[2]; ++q, ++row) {
        const int64_t o = b * t.b + n * t.n + q * t.s;
        f(in + row * d, c + o, s + o, out + row * d, d / 2);
      }
    }
  }
  return 0;
}
}  // namespace

extern "C" int RotaryHalf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  if (nparam != 4) return 1;
  return for_rows(ndims, shapes, params, [](const float *x, const float *c, const float *s, float *y, int64_t h) {
    for (int64_t j = 0; j < h; ++j) {
      const float a = x[j] * c[j];
      const float r = -x[j + h];
      const float q = r * s[j];
      y[j] = a + q;
    }
    for (int64_t j = h; j < 2 * h; ++j) {
      const float a = x[j] * c[j];
      const float q = x[j - h] * s[j];
      y[j] = a + q;
    }
  });
}

extern "C" int RotaryHalfGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 4) return 1;
  return for_rows(ndims, shapes, params, [](const float *g, const float *c, const float *s, float *y, int64_t h) {
    for (int64_t j = 0; j < h; ++j) {
      const float a = g[j] * c[j];
      const float q = g[j + h] * s[j + h];
      y[j] = a + q;
    }
    for (int64_t j = h; j < 2 * h; ++j) {
      const float a = g[j] * c[j];
      const float q = -(g[j - h] * s[j - h]);
      y[j] = a + q;
    }
  });
}
