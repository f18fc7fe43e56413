// CPU kernels for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
//
// SegmentBias / SegmentBiasCausal: segment ids q [B, L] and k [B, S] (float32 holding integers) -> the
//   additive attention bias [B, 1, L, S] of ops/attention.py `segment_bias`: query i may see key j when
//   q[i] == k[j] and q[i] > 0 (and, causal, j <= i + S - L). The composite writes cast(not allowed) *
//   -1e9, so an allowed entry is 0 * -1e9 = -0.0 and a masked one -1e9: the same values here, bit for bit.
//   One pass instead of the composite's Equal, Greater, LessEqual, three logical ops, Cast and Mul kernels
//   over [B, L, S] and the [B, 1, L, S] copy that inserts the head axis.
// ScaleBiasAdd: scores [B, G, R, S], bias [Bb, 1, L, S] (Bb = 1 or B, R a multiple of L), scale [1] or [] ->
//   scores * scale + bias, bias row r % L for score row r: broadcast over heads, over the R / L query heads
//   stacked along the rows of a grouped-query head group (ops/attention.py CoreAttention), and over the
//   rows of the batch when Bb = 1. Each product and sum is
//   rounded as MindSpore's Mul and Add kernels round them (built with -ffp-contract=off), so the result
//   equals the composite's bit for bit, without its BroadcastTo of the bias to [B, H, L, S].
// Single-threaded, as qkv_rope.cc.
#include <cstdint>
#include <cstring>
#include <vector>

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

namespace {
const float kNegInf = -1e9f;  // ops/attention.py NEG_INF

std::vector<int64_t> bias_shape(int *ndims, int64_t **shapes) {  // [B, L] x [B, S] -> [B, 1, L, S]
  const int64_t b = ndims[0] == 2 ? shapes[0][0] : -1;
  const int64_t l = ndims[0] == 2 ? shapes[0][1] : -1;
  const int64_t s = ndims[1] == 2 ? shapes[1][1] : -1;
  return std::vector<int64_t>{b, 1, l, s};
}

int segment_bias(void **params, int *ndims, int64_t **shapes, bool causal) {
  if (ndims[0] != 2 || ndims[1] != 2 || shapes[0][0] != shapes[1][0]) return 1;
  const int64_t b = shapes[0][0], l = shapes[0][1], s = shapes[1][1];
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t i = 0; i < l; ++i) {
      const float qi = q[r * l + i];
      const float *kr = k + r * s;
      float *o = out + (r * l + i) * s;
      const int64_t last = causal ? i + s - l : s - 1;  // the last key position query i may see
      for (int64_t j = 0; j < s; ++j) {
        const bool allowed = qi == kr[j] && qi > 0.0f && j <= last;
        o[j] = static_cast<float>(!allowed) * kNegInf;
      }
    }
  }
  return 0;
}
}  // namespace

extern "C" std::vector<int64_t> SegmentBiasInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return bias_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> SegmentBiasCausalInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return bias_shape(ndims, shapes);
}

extern "C" std::vector<int64_t> ScaleBiasAddInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" TypeId SegmentBiasInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId SegmentBiasCausalInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId ScaleBiasAddInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" int SegmentBias(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 3) return 1;
  return segment_bias(params, ndims, shapes, false);
}

extern "C" int SegmentBiasCausal(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  if (nparam != 3) return 1;
  return segment_bias(params, ndims, shapes, true);
}

extern "C" int ScaleBiasAdd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 4 || ndims[0] != 4 || ndims[1] != 4) return 1;
  const int64_t *x = shapes[0], *bs = shapes[1];
  if (bs[1] != 1 || bs[3] != x[3] || bs[2] < 1 || x[2] % bs[2] || (bs[0] != 1 && bs[0] != x[0])) return 1;
  int64_t n_scale = 1;
  for (int i = 0; i < ndims[2]; ++i) n_scale *= shapes[2][i];
  if (n_scale != 1) return 1;
  const float *in = static_cast<const float *>(params[0]);
  const float *bias = static_cast<const float *>(params[1]);
  const float scale = *static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t s = x[3], plane = bs[2] * s;  // one head's [L, S] bias
  for (int64_t b = 0; b < x[0]; ++b) {
    const float *brow = bias + (bs[0] == 1 ? 0 : b * plane);
    for (int64_t g = 0; g < x[1]; ++g) {
      for (int64_t r = 0; r < x[2]; ++r) {  // rows r, r + L, ... (the query heads stacked) share bias row r % L
        const int64_t o = ((b * x[1] + g) * x[2] + r) * s;
        const float *bi = brow + (r % bs[2]) * s;
        for (int64_t j = 0; j < s; ++j) {
          const float t = in[o + j] * scale;
          out[o + j] = t + bi[j];
        }
      }
    }
  }
  return 0;
}

// SwapAxes12: x [A, B, C, D] -> y [A, C, B, D] (y[a, c, b, :] = x[a, b, c, :]), the heads <-> tokens
//   transposes of the LLM attention ([B, L, H, hd] <-> [B, H, L, hd]); its gradient is the same op. A copy
//   of D-float rows: the values are the input's, bit for bit, without MindSpore's Transpose kernel and its
//   per-element index table under dynamic shapes.
extern "C" std::vector<int64_t> SwapAxes12InferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  if (ndims[0] != 4) return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
  return std::vector<int64_t>{shapes[0][0], shapes[0][2], shapes[0][1], shapes[0][3]};
}

extern "C" TypeId SwapAxes12InferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" int SwapAxes12(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  if (nparam != 2 || ndims[0] != 4) return 1;
  const int64_t *x = shapes[0];
  const int64_t nb = x[1], nc = x[2], d = x[3];
  const float *in = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[1]);
  for (int64_t a = 0; a < x[0]; ++a) {
    const float *src = in + a * nb * nc * d;
    float *dst = out + a * nb * nc * d;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t c = 0; c < nc; ++c) {
        std::memcpy(dst + (c * nb + b) * d, src + (b * nc + c) * d, sizeof(float) * d);
      }
    }
  }
  return 0;
}

// MulScale: a, b of one shape, s [1] or [] -> (a * b) * s, each product rounded as MindSpore's Mul kernels
//   round it: the softmax backward's P * (dP - D) and the attention scale's gradient in one pass
//   (ops/attention.py `_SoftmaxVScaleGrad`).
extern "C" std::vector<int64_t> MulScaleInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" TypeId MulScaleInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" int MulScale(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                        void *stream, void *extra) {
  if (nparam != 4 || ndims[0] != ndims[1]) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) {
    if (shapes[0][i] != shapes[1][i]) return 1;
    n *= shapes[0][i];
  }
  int64_t n_scale = 1;
  for (int i = 0; i < ndims[2]; ++i) n_scale *= shapes[2][i];
  if (n_scale != 1) return 1;
  const float *a = static_cast<const float *>(params[0]);
  const float *b = static_cast<const float *>(params[1]);
  const float s = *static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  for (int64_t i = 0; i < n; ++i) {
    const float t = a[i] * b[i];
    out[i] = t * s;
  }
  return 0;
}

// BlocksToHeads: x [S, W, 3, H, hd] -> [3, S, H, W, hd] (transpose (2, 0, 3, 1, 4)), the ViT block path's
//   gathered qkv rows to per-head q/k/v blocks; HeadsToBlocks is its inverse ((1, 3, 0, 2, 4)) and each is
//   the other's gradient. Copies of hd-float rows: the input's values bit for bit.
namespace {
// out[o0, o1, o2, o3, :] = in[i0, i1, i2, i3, :] where in's axis perm[k] is out's axis k
int permute_rows(void **params, int *ndims, int64_t **shapes, const int perm[4]) {
  if (ndims[0] != 5) return 1;
  const int64_t *x = shapes[0];
  const int64_t d = x[4];
  int64_t in_stride[4];
  in_stride[3] = d;
  for (int k = 2; k >= 0; --k) in_stride[k] = in_stride[k + 1] * x[k + 1];
  const int64_t o[4] = {x[perm[0]], x[perm[1]], x[perm[2]], x[perm[3]]};
  const int64_t s[4] = {in_stride[perm[0]], in_stride[perm[1]], in_stride[perm[2]], in_stride[perm[3]]};
  const float *in = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[1]);
  for (int64_t a = 0; a < o[0]; ++a) {
    for (int64_t b = 0; b < o[1]; ++b) {
      for (int64_t c = 0; c < o[2]; ++c) {
        const float *src = in + a * s[0] + b * s[1] + c * s[2];
        for (int64_t e = 0; e < o[3]; ++e, out += d) std::memcpy(out, src + e * s[3], sizeof(float) * d);
      }
    }
  }
  return 0;
}

const int kToHeads[4] = {2, 0, 3, 1};
const int kToBlocks[4] = {1, 3, 0, 2};

std::vector<int64_t> permuted_shape(int *ndims, int64_t **shapes, const int perm[4]) {
  if (ndims[0] != 5) return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
  const int64_t *x = shapes[0];
  return std::vector<int64_t>{x[perm[0]], x[perm[1]], x[perm[2]], x[perm[3]], x[4]};
}
}  // namespace

extern "C" std::vector<int64_t> BlocksToHeadsInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return permuted_shape(ndims, shapes, kToHeads);
}

extern "C" std::vector<int64_t> HeadsToBlocksInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return permuted_shape(ndims, shapes, kToBlocks);
}

extern "C" TypeId BlocksToHeadsInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" TypeId HeadsToBlocksInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" int BlocksToHeads(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 2) return 1;
  return permute_rows(params, ndims, shapes, kToHeads);
}

extern "C" int HeadsToBlocks(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 2) return 1;
  return permute_rows(params, ndims, shapes, kToBlocks);
}
