// CPU kernel for MindSpore's `ops.Custom(func_type="aot")`, built by mindvl_ms/ops/cpu_kernels.py.
//
// SumSquares: y = sum over every element of (x * s)^2, for x of any shape and a scalar s; y has shape [1].
//   The global gradient norm's per-accumulator term (train/step_cells.py ReduceStep): one pass over x
//   instead of MindSpore's Mul, Square and two ReduceSum kernels per block of rows, with their temporaries.
//   x * s is rounded to float32 as the Mul kernel rounds it; its square and the sum are kept in double
//   (8 partial sums), so the result is at least as accurate as the float32 reductions it replaces, not
//   bitwise equal to them. Single-threaded, as the other kernels here.
#include <cstdint>
#include <vector>

class AotExtra;         // MindSpore's attribute accessor (custom_aot_extra.h); unused here
enum TypeId : int {};  // MindSpore's dtype ids, passed through

extern "C" std::vector<int64_t> SumSquaresInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  return std::vector<int64_t>{1};
}

extern "C" TypeId SumSquaresInferType(std::vector<TypeId> type_ids, AotExtra *extra) { return type_ids[0]; }

extern "C" int SumSquares(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  if (nparam != 3 || ndims[1] != 0) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float *x = static_cast<const float *>(params[0]);
  const float s = *static_cast<const float *>(params[1]);
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double y = static_cast<double>(x[i + k] * s);
      part[k] += y * y;
    }
  }
  for (; i < n; ++i) {
    const double y = static_cast<double>(x[i] * s);
    part[0] += y * y;
  }
  const double total = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  *static_cast<float *>(params[2]) = static_cast<float>(total);
  return 0;
}
