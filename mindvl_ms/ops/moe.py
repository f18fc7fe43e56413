"""MoE primitives with one semantics on every device: top-k, sort, cumsum, token permute/unpermute,
grouped matmul.

MindFormers' MoE (router, token dispatcher, grouped experts) calls Ascend-only primitives: `TopkExt`,
`SortExt`, `CumsumExt`, `MoeTokenPermute`/`MoeTokenUnpermute`, `GroupedMatmul`. Each cell below decides
once, at construction (`is_ascend()`), whether to call that fused primitive or a CPU equivalent written with
primitives MindSpore has on CPU (TopK, Sort, CumSum, Gather, ScatterNd, BatchMatMul). The CPU branches are
unit-tested against numpy (tests/ops/test_moe_ops.py); the Ascend branches pass the same inputs in the layouts
the fused kernels take and run only on Ascend hardware.

Semantics (T tokens, k experts per token, E experts, M = T * k routed rows):
  TopK:            x [..., N], k -> values [..., k] (descending), indices int32 [..., k]
  Sort:            x [..., N] -> ascending values, int32 indices
  Cumsum:          x [..., N] along `axis`
  TokenPermute:    tokens [T, D], expert_ids int32 [T, k] -> permuted [M, D] (rows grouped by expert,
                   ascending), sorted_indices int32 [M] with permuted[i] = tokens[sorted_indices[i] // k]
                   (MoeTokenPermute / Megatron `permute`)
  TokenUnpermute:  permuted [M, D], sorted_indices [M], probs [T, k] -> [T, D],
                   out[t] = sum_j probs[t, j] * permuted[pos(t * k + j)], pos = inverse of sorted_indices
  GroupedMatmul:   x [M, K] (rows grouped by expert), w [E, K, N], group_list int64 [E] cumulative row
                   counts -> y [M, N], y[m] = x[m] @ w[expert of row m]. The CPU equivalent computes every
                   expert on every row and keeps the matching one (E times the work of the fused kernel,
                   exact, static shapes, differentiable); it is meant for tiny CPU models and tests.
  capacity_layout: expert_ids [T, k] -> slots in an [E, C] layout (valid when no expert has more than C
                   copies) for the CPU sparse experts (RoutedExperts dispatch "sparse")
  block_layout:    expert_ids [T, k] -> a padded, expert-pure row-block layout (static bound, valid for any
                   routing): the sparse experts' fallback when an expert overflows C
"""
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.auto_generate import CumsumExt, GroupedMatmul as GroupedMatmulExt, SortExt, TopkExt

from mindvl_ms.ops.dispatch import is_ascend


class TopK(nn.Cell):
    """Largest k along the last axis: (values, int32 indices)."""

    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        if self.fused:
            self.topk_ext = TopkExt()
        else:
            self.topk_cpu = ops.TopK(sorted=True)

    def construct(self, x, k: int):
        if self.fused:
            values, idx = self.topk_ext(x, k)
        else:
            values, idx = self.topk_cpu(x, k)
        return values, idx.astype(ms.int32)


class Sort(nn.Cell):
    """Ascending sort along the last axis: (values, int32 indices)."""

    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        if self.fused:
            self.sort_ext = SortExt()
        else:
            self.sort_cpu = ops.Sort(axis=-1, descending=False)

    def construct(self, x):
        if self.fused:
            values, idx = self.sort_ext(x, -1)
        else:
            values, idx = self.sort_cpu(x)
        return values, idx.astype(ms.int32)


class Cumsum(nn.Cell):
    """Inclusive cumulative sum along `axis`."""

    def __init__(self, axis: int = -1):
        super().__init__()
        self.axis = axis
        self.fused = is_ascend()
        if self.fused:
            self.cumsum_ext = CumsumExt()

    def construct(self, x):
        if self.fused:
            return self.cumsum_ext(x, self.axis, None)
        return ops.cumsum(x, self.axis)


class TokenPermute(nn.Cell):
    """Group token copies by expert: tokens [T, D], expert_ids int32 [T, k] -> ([T*k, D], int32 [T*k])."""

    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        self.sort = Sort()

    def construct(self, tokens, expert_ids):
        if self.fused:
            permuted, sorted_indices = ops.moe_token_permute(tokens, expert_ids)
            return permuted, sorted_indices.astype(ms.int32)
        k = expert_ids.shape[-1]
        flat = expert_ids.reshape(-1)  # [M]
        # a stable order inside each expert: sort on expert * M + position (exact in float32 below 2^24;
        # beyond that rounding is monotonic, so rows stay grouped by expert)
        m = flat.shape[0]
        pos = ops.arange(0, m, dtype=ms.int32)
        _, sorted_indices = self.sort((flat * m + pos).astype(ms.float32))  # [M]
        permuted = ops.gather(tokens, sorted_indices // k, 0)  # [M, D]
        return permuted, sorted_indices


class TokenUnpermute(nn.Cell):
    """Inverse of TokenPermute with the routing weights: [T*k, D], [T*k], probs [T, k] -> [T, D]."""

    def __init__(self):
        super().__init__()
        self.fused = is_ascend()

    def construct(self, permuted, sorted_indices, probs):
        if self.fused:
            return ops.moe_token_unpermute(permuted, sorted_indices, probs.astype(permuted.dtype))
        t, k = probs.shape
        m = sorted_indices.shape[0]
        # inverse permutation: position in `permuted` of the copy (t, j) = row t * k + j
        inverse = ops.scatter_nd(sorted_indices.reshape(m, 1), ops.arange(0, m, dtype=ms.int32), (m,))
        rows = ops.gather(permuted, inverse, 0).reshape(t, k, -1)  # [T, k, D]
        return (rows * probs.astype(permuted.dtype)[:, :, None]).sum(1)  # [T, D]


class GroupedMatmul(nn.Cell):
    """y[m] = x[m] @ w[g(m)] for rows grouped by expert; group_list int64 [E] cumulative counts."""

    def __init__(self):
        super().__init__()
        self.fused = is_ascend()
        if self.fused:
            self.gmm = GroupedMatmulExt(split_item=3, group_type=0)

    def construct(self, x, w, group_list):
        if self.fused:
            return self.gmm([x], [w], None, None, None, None, None, group_list)[0]
        m = x.shape[0]
        e = w.shape[0]
        row = ops.arange(0, m, dtype=ms.int64)  # [M]
        # expert of row m = number of group ends <= m
        expert = (row[:, None] >= group_list.astype(ms.int64)[None, :]).astype(ms.int32).sum(1)  # [M]
        onehot = ops.one_hot(expert, e, Tensor(1.0, x.dtype), Tensor(0.0, x.dtype))  # [M, E]
        y = ops.matmul(x[None], w)  # [E, M, N]
        return (y * onehot.T[:, :, None]).sum(0)  # [M, N]


def tokens_per_expert(expert_ids, num_experts: int, weights=None):
    """expert_ids int32 [T, k] -> float32 [E] count of routed copies per expert (optionally weighted [T])."""
    onehot = ops.one_hot(expert_ids, num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))  # [T, k, E]
    counts = onehot.sum(1)  # [T, E]
    if weights is not None:
        counts = counts * weights.astype(ms.float32)[:, None]
    return counts.sum(0)


def expert_block_size(rows: int, num_experts: int) -> int:
    """Row-block size of the block-sparse expert layout: a power of two near rows / (2 E), in [8, 128].

    Padding costs at most E * (block - 1) rows and the per-block weight gather costs rows / block + E expert
    weight copies; half the mean group size keeps both near the routed rows (block sizes compared:
    docs/PERFORMANCE.md, "## ops").
    """
    target = max(1, rows // (2 * num_experts))
    block = 8
    while block < target and block < 128:
        block *= 2
    return block


def expert_capacity(rows: int, num_experts: int) -> int:
    """Rows per expert of the capacity layout: mean + 4 sqrt(mean) (at least 1.25 mean), a multiple of 8.

    Under balanced routing a count above mean + 4 sqrt(mean) is rare; when it happens the caller falls back
    to the block layout, so the capacity only decides speed, never the result.
    """
    mean = rows / num_experts
    cap = max(1.25 * mean, mean + 4.0 * mean ** 0.5)
    return min(int(-(-cap // 8) * 8), rows)


def expert_ranks(expert_ids, num_experts: int):
    """expert_ids int32 [T, k] -> flat ids [M], rank of each copy among its expert's copies (token order)
    float32 [M], and copies per expert float32 [E]. Index arithmetic only (no gradient)."""
    flat = expert_ids.reshape(-1)  # [M]
    onehot = ops.one_hot(flat, num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))  # [M, E]
    rank = ((ops.cumsum(onehot, 0) - onehot) * onehot).sum(1)  # [M] copies of the same expert before m
    return flat, ops.stop_gradient(rank), ops.stop_gradient(onehot.sum(0))


def _slot_tokens(dest, t: int, k: int, slots: int):
    """Token feeding each slot (t for an empty one) from the slot of every routed copy."""
    m = t * k
    token = ops.arange(0, m, dtype=ms.int32) // k  # [M]
    slot_token = ops.scatter_nd(dest.reshape(m, 1), token + 1, (slots,)) - 1  # -1 = empty
    return ops.where(slot_token < 0, ops.full_like(slot_token, t), slot_token)


def capacity_layout(expert_ids, rank, num_experts: int, capacity: int):
    """[E, C] layout: copy m of expert e goes to slot e * C + rank_m. Valid only when no expert has more than
    C copies (the caller checks counts.max() <= C). -> dest int32 [M], slot_token int32 [E*C]."""
    t, k = expert_ids.shape
    dest = (expert_ids.reshape(-1) * capacity + rank.astype(ms.int32)).astype(ms.int32)  # [M]
    dest = ops.minimum(dest, num_experts * capacity - 1)  # in range even when the branch is not taken
    return ops.stop_gradient(dest), ops.stop_gradient(_slot_tokens(dest, t, k, num_experts * capacity))


def block_layout(expert_ids, num_experts: int, block: int, rank=None, counts=None):
    """Static-shape layout of T*k routed rows into expert-pure row blocks (no sort, nothing dropped).

    expert_ids int32 [T, k] ->
      dest        int32 [M]   slot of routed copy m = t*k + j in the padded layout
      slot_token  int32 [P]   token feeding each slot, T for an empty (padding) slot
      block_expert int32 [NB] expert of each block of `block` slots
    with M = T*k, NB = (M + E*(block-1)) // block, P = NB*block. Expert e's copies fill slots
    [off_e, off_e + c_e) in token order, off_e = sum_{e' < e} ceil(c_e'/block)*block; as
    sum_e ceil(c_e/block)*block <= M + E*(block-1) and is a multiple of block, every copy gets a slot for any
    routing (the bound is P). Blocks past the last used one get expert E-1 and only empty slots.
    """
    t, k = expert_ids.shape
    m = t * k
    nb = (m + num_experts * (block - 1)) // block
    flat = expert_ids.reshape(-1)  # [M]
    if rank is None:
        _, rank, counts = expert_ranks(expert_ids, num_experts)
    padded = ops.ceil(counts / block) * block  # [E]
    ends = ops.cumsum(padded, 0)  # [E] padded group ends
    dest = (ops.gather(ends - padded, flat, 0) + rank).astype(ms.int32)  # [M]
    slot_token = _slot_tokens(dest, t, k, nb * block)  # [P]
    starts = ops.arange(0, nb, dtype=ms.float32) * block  # [NB]
    block_expert = (ends[None, :] <= starts[:, None]).astype(ms.int32).sum(1)  # [NB]
    block_expert = ops.minimum(block_expert, num_experts - 1)
    return ops.stop_gradient(dest), ops.stop_gradient(slot_token), ops.stop_gradient(block_expert)
