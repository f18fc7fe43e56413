// CPU kernels for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
//
// QkvBiasRope: bias add and 2D RoPE (rotate-half layout) over a fused qkv projection, in one pass.
//   mm [N, 3*H*hd]: x @ W_qkv^T without its bias; b [3*H*hd]; c, s [N, 2, hd]: cos/sin of each row for
//   the queries (already times the attention scale) and for the keys.
//   out = t * c + rotate_half(t) * s for the q and k parts, t for the v part, where t = mm + b and
//   rotate_half(t) = [-t2, t1] per head. Every float op is rounded as MindSpore's separate CPU kernels
//   round it (build with -ffp-contract=off: no fused multiply-add), so the result equals the unfused
//   BiasAdd, rotate-half MatMul, Mul, Mul, Add bit for bit.
// QkvRopeGrad: d(mm) = dout * c + rotate_half^T(dout * s) for q and k, dout for v, with
//   rotate_half^T(y) = [y2, -y1] per head (the unfused path's gradient, bit for bit).
// Single-threaded: the kernel is memory-bound, and an OpenMP pool next to MindSpore's own threads kept
// 2 cores busy-waiting.
#include <cstdint>
#include <cstring>
#include <vector>

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

namespace {
// Both kernels return their first input's shape; MindSpore calls these for the output shape (dynamic
// shapes included: a dimension of -1, or a rank of -2, is passed through).
std::vector<int64_t> same_shape(int *ndims, int64_t **shapes) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
}  // namespace

extern "C" std::vector<int64_t> QkvBiasRopeInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return same_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> QkvRopeGradInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return same_shape(ndims, shapes);
}

extern "C" TypeId QkvBiasRopeInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId QkvRopeGradInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

namespace {
struct Dims {
  int64_t n, e3, e, hd, heads, half;
};

Dims dims(int64_t **shapes, int table) {
  Dims d;
  d.n = shapes[0][0];
  d.e3 = shapes[0][1];
  d.e = d.e3 / 3;
  d.hd = shapes[table][2];
  d.heads = d.e / d.hd;
  d.half = d.hd / 2;
  return d;
}
}  // namespace

extern "C" int QkvBiasRope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 5) return 1;
  const float *mm = static_cast<const float *>(params[0]);
  const float *b = static_cast<const float *>(params[1]);
  const float *c = static_cast<const float *>(params[2]);
  const float *s = static_cast<const float *>(params[3]);
  float *out = static_cast<float *>(params[4]);
  const Dims d = dims(shapes, 2);
  for (int64_t i = 0; i < d.n; ++i) {
    const float *x = mm + i * d.e3;
    float *y = out + i * d.e3;
    for (int64_t p = 0; p < 2; ++p) {  // q, k
      const float *cp = c + (i * 2 + p) * d.hd;
      const float *sp = s + (i * 2 + p) * d.hd;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t o = p * d.e + h * d.hd;
        const float *xh = x + o;
        const float *bh = b + o;
        float *yh = y + o;
        for (int64_t j = 0; j < d.half; ++j) {
          const float t = xh[j] + bh[j];
          const float r = -(xh[j + d.half] + bh[j + d.half]);
          const float a = t * cp[j];
          const float q = r * sp[j];
          yh[j] = a + q;
        }
        for (int64_t j = d.half; j < d.hd; ++j) {
          const float t = xh[j] + bh[j];
          const float r = xh[j - d.half] + bh[j - d.half];
          const float a = t * cp[j];
          const float q = r * sp[j];
          yh[j] = a + q;
        }
      }
    }
    for (int64_t j = 2 * d.e; j < d.e3; ++j) y[j] = x[j] + b[j];  // v
  }
  return 0;
}

extern "C" int QkvRopeGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 4) return 1;
  const float *dout = static_cast<const float *>(params[0]);
  const float *c = static_cast<const float *>(params[1]);
  const float *s = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const Dims d = dims(shapes, 1);
  for (int64_t i = 0; i < d.n; ++i) {
    const float *x = dout + i * d.e3;
    float *y = out + i * d.e3;
    for (int64_t p = 0; p < 2; ++p) {
      const float *cp = c + (i * 2 + p) * d.hd;
      const float *sp = s + (i * 2 + p) * d.hd;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t o = p * d.e + h * d.hd;
        const float *xh = x + o;
        float *yh = y + o;
        for (int64_t j = 0; j < d.half; ++j) {
          const float a = xh[j] * cp[j];
          const float q = xh[j + d.half] * sp[j + d.half];
          yh[j] = a + q;
        }
        for (int64_t j = d.half; j < d.hd; ++j) {
          const float a = xh[j] * cp[j];
          const float q = -(xh[j - d.half] * sp[j - d.half]);
          yh[j] = a + q;
        }
      }
    }
    std::memcpy(y + 2 * d.e, x + 2 * d.e, sizeof(float) * d.e);  // v
  }
  return 0;
}
