"""MindFormers 1.9.0's MoE layer (TopKRouter -> MoEAlltoAllTokenDispatcher -> GroupedMatmul experts, inside
its MoELayer with the Morph reshapes) run on CPU with this project's weights, against this project's
DeepseekV3MoE: outputs and gradients agree where the routing rules agree (num_experts_per_tok / topk_group
= 2), and differ, as shown here, where they do not.

MindFormers calls Ascend-only kernels (TopkExt, OneHotExt, SortExt, CumsumExt, IndexSelect, FmodScalar,
GroupedMatmul, Swiglu, MoveTo); inside this test only, monkeypatch replaces them by CPU equivalents with the
same call signatures and semantics (`mindspore.ops` built-ins; the grouped matmul is the one-hot masked
dense product of `mindvl_ms.ops.moe.GroupedMatmul`'s CPU branch).
"""
import os
from types import SimpleNamespace

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn, ops

from mindvl_ms.config import load_model_config
from mindvl_ms.config.model import MoEConfig, TextConfig
from mindvl_ms.config.train import RunConfig
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import mindformers_moe  # noqa: F401  (sets MindFormers' log dir before its import)
from mindvl_ms.models.moe import DeepseekV3MoE
from mindvl_ms.parallel.mindformers_moe import routing_rules_agree, transformer_config
from mindvl_ms.parallel.moe import use_mindformers
from mindvl_ms.train import build
from tests.support.paths import ROOT


# ---- CPU stand-ins with the Ascend primitives' call signatures (jit_class: usable inside graphs) ----
@ms.jit_class
class _TopkCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002  (TopkExt's argument name)
        values, idx = ops.topk(x, k, dim, largest, sorted)
        return values, idx.astype(ms.int64)

    def recompute(self, mode=True):
        return self


@ms.jit_class
class _SortCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, dim=-1, descending=False, stable=False):
        values, idx = ops.sort(x, dim, descending)
        return values, idx.astype(ms.int64)


@ms.jit_class
class _OneHotCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, indices, depth, on_value, off_value, axis=-1):
        return ops.one_hot(indices.astype(ms.int32), depth, on_value, off_value, axis)

    def recompute(self, mode=True):
        return self


@ms.jit_class
class _CumsumCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, dim, dtype=None):
        return ops.cumsum(x, dim)


@ms.jit_class
class _IndexSelectCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, dim, index):
        return ops.gather(x, index.astype(ms.int32), dim)


@ms.jit_class
class _FmodScalarCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, other):
        return ops.floor_mod(x, other)


@ms.jit_class
class _SwigluCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, dim=-1):
        a, b = ops.chunk(x, 2, dim)  # Swiglu: silu(first half) * second half
        return ops.silu(a) * b

    def recompute(self, mode=True):
        return self


@ms.jit_class
class _GroupedMatmulCPU:
    """GroupedMatmul(split_item=3, group_type=0)([x], [w], ..., group_list) -> [y], y[m] = x[m] @ w[g(m)]."""

    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, w, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                 group_list=None):
        x, w = x[0], w[0]
        m = x.shape[0]
        e = w.shape[0]
        row = ops.arange(0, m, dtype=ms.int64)
        expert = (row[:, None] >= group_list.astype(ms.int64)[None, :]).astype(ms.int32).sum(1)  # [M]
        onehot = ops.one_hot(expert, e, Tensor(1.0, x.dtype), Tensor(0.0, x.dtype))  # [M, E]
        y = ops.matmul(x[None], w)  # [E, M, N]
        return [(y * onehot.T[:, :, None]).sum(0)]


@ms.jit_class
class _MoveToCPU:
    def __init__(self, *args, **kwargs):
        self.flag = 0

    def __call__(self, x, to="CPU", blocking=True):
        return x

    def add_prim_attr(self, name, value):
        return self

    def recompute(self, mode=True):
        return self


@pytest.fixture
def cpu_mindformers(monkeypatch):
    """MindFormers' MoE modules with their Ascend-only primitives replaced by the CPU stand-ins above."""
    from mindformers.parallel_core.training_graph.transformer.moe import ffn, moe_layer, router, token_dispatcher

    for mod, names in ((router, ("TopkExt", "OneHotExt")),
                       (token_dispatcher, ("CumsumExt", "SortExt", "IndexSelect", "OneHotExt", "FmodScalar")),
                       (ffn, ("GroupedMatmul", "Swiglu"))):
        for name in names:
            sub = {"TopkExt": _TopkCPU, "OneHotExt": _OneHotCPU, "CumsumExt": _CumsumCPU, "SortExt": _SortCPU,
                   "IndexSelect": _IndexSelectCPU, "FmodScalar": _FmodScalarCPU, "GroupedMatmul": _GroupedMatmulCPU,
                   "Swiglu": _SwigluCPU}[name]
            monkeypatch.setattr(mod, name, sub)
    monkeypatch.setattr(ms.ops, "MoveTo", _MoveToCPU)
    return moe_layer, ffn


def text_config(e, k, groups, topk_group):
    moe = MoEConfig(n_routed_experts=e, num_experts_per_tok=k, n_group=groups, topk_group=topk_group,
                    n_shared_experts=0, moe_intermediate_size=24, routed_scaling_factor=2.5, seq_aux_loss_coef=0.0)
    return TextConfig(model_type="deepseek_v3", hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                      vocab_size=64, num_hidden_layers=2, intermediate_size=48, moe=moe)


def build_ours(tc):
    """This project's DeepseekV3MoE with seeded weights."""
    ours = DeepseekV3MoE(tc)
    rng = np.random.default_rng(0)
    for _, p in ours.parameters_and_names():
        p.set_data(Tensor((rng.standard_normal(p.shape) * 0.2).astype(np.float32)))
    return ours


def build_theirs(cpu_mindformers, ours, tc, seq):
    """MindFormers' MoELayer holding `ours`' weights."""
    moe_layer, ffn = cpu_mindformers
    m = tc.moe
    cfg = transformer_config(m.n_routed_experts, m.num_experts_per_tok, tc.hidden_size, seq_length=seq, moe=m)
    cfg.moe_router_load_balancing_type = "seq_aux_loss"
    cfg.moe_aux_loss_coeff = 0.0
    theirs = moe_layer.MoELayer(cfg, moe_layer.MoESubmodules(experts=ffn.FFNGroupedGEMM))
    e, d, inter = ours.experts.gate_proj.shape
    gate, up, down = (p.asnumpy() for p in (ours.experts.gate_proj, ours.experts.up_proj, ours.experts.down_proj))
    theirs.router.weight.set_data(Tensor(ours.gate.weight.asnumpy()))
    theirs.router.expert_bias.set_data(Tensor(ours.gate.e_score_correction_bias.asnumpy()))
    theirs.experts.weight1.set_data(Tensor(np.concatenate([gate, up], -1).reshape(e * d, 2 * inter)))
    theirs.experts.weight2.set_data(Tensor(down.reshape(e * inter, d)))
    return theirs


def build_pair(cpu_mindformers, tc, seq):
    """This project's DeepseekV3MoE and MindFormers' MoELayer holding the same weights."""
    ours = build_ours(tc)
    return ours, build_theirs(cpu_mindformers, ours, tc, seq)


class OursLoss(nn.Cell):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def construct(self, x, g, valid):
        y, _, _ = self.moe(x, valid)  # [B, L, D]
        return (y * g).sum()


class TheirsLoss(nn.Cell):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def construct(self, x, g):
        y, _, _ = self.moe(x.swapaxes(0, 1))  # MindFormers takes and returns [S, B, H]
        return (y.swapaxes(0, 1) * g).sum()


def inputs(b, seq, d, seed):
    """x, the output's cotangent g ([B, L, D] each) and every token valid."""
    rng = np.random.default_rng(seed)
    x = Tensor(rng.standard_normal((b, seq, d)).astype(np.float32))
    g = Tensor(rng.standard_normal((b, seq, d)).astype(np.float32))
    return x, g, Tensor(np.ones(b * seq, np.float32))


def loss_and_grads(loss, *args):
    """The loss, its gradient in x and {parameter name inside the MoE layer: gradient}."""
    v, (gx, gw) = ms.value_and_grad(loss, 0, loss.trainable_params())(*args)
    names = [p.name.split("moe.")[-1] for p in loss.trainable_params()]
    return v.asnumpy(), gx.asnumpy(), {n: a.asnumpy() for n, a in zip(names, gw)}


def run_both(ours, theirs, b, seq, d):
    x, g, valid = inputs(b, seq, d, 1)
    return loss_and_grads(OursLoss(ours), x, g, valid), loss_and_grads(TheirsLoss(theirs), x, g)


B, SEQ = 2, 12


@pytest.fixture(scope="module")
def agreeing():
    """This project's layer where the routing rules agree (16 experts, top 4 of 4 groups' best 2), its inputs and
    its loss and gradients on them: computed (and compiled) once for the two tests that compare other layers
    against it."""
    tc = text_config(e=16, k=4, groups=4, topk_group=2)  # 4 // 2 = 2: both rules sum each group's top 2
    ours = build_ours(tc)
    x, g, valid = inputs(B, SEQ, tc.hidden_size, 1)
    return SimpleNamespace(tc=tc, ours=ours, x=x, g=g, valid=valid, got=loss_and_grads(OursLoss(ours), x, g, valid))


def test_mindformers_moe_layer_equals_ours_where_routing_rules_agree(cpu_mindformers, agreeing):
    tc, ours = agreeing.tc, agreeing.ours
    assert routing_rules_agree(tc.moe)
    theirs = build_theirs(cpu_mindformers, ours, tc, SEQ)
    (vo, gxo, go), (vt, gxt, gt) = agreeing.got, loss_and_grads(TheirsLoss(theirs), agreeing.x, agreeing.g)
    np.testing.assert_allclose(vt, vo, rtol=1e-5)
    np.testing.assert_allclose(gxt, gxo, rtol=1e-4, atol=1e-5)
    e, d, inter = ours.experts.gate_proj.shape
    np.testing.assert_allclose(gt["router.weight"], go["gate.weight"], rtol=1e-4, atol=1e-5)
    w1 = gt["experts.weight1"].reshape(e, d, 2 * inter)
    np.testing.assert_allclose(w1[..., :inter], go["experts.gate_proj"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w1[..., inter:], go["experts.up_proj"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gt["experts.weight2"].reshape(e, inter, d), go["experts.down_proj"],
                               rtol=1e-4, atol=1e-5)


def numpy_route(scores, k, groups, topk_group, per_group_top):
    """Group-limited top-k: groups ranked by the sum of their `per_group_top` best scores."""
    t, e = scores.shape
    grouped = scores.reshape(t, groups, e // groups)
    gscore = -np.sort(-grouped, -1)[..., :per_group_top].sum(-1)  # [T, G]
    keep = np.argsort(-gscore, -1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, groups), bool)
    np.put_along_axis(mask, keep, True, -1)
    masked = np.where(np.repeat(mask, e // groups, -1), scores, 0.0)
    return np.sort(np.argsort(-masked, -1, kind="stable")[:, :k], -1)


def test_mindformers_group_score_differs_when_k_over_topk_group_is_not_2(cpu_mindformers):
    tc = text_config(e=16, k=6, groups=4, topk_group=2)  # MindFormers: top-3 per group; DeepSeek-V3: top-2
    assert not routing_rules_agree(tc.moe)
    b, seq = 2, 12
    ours, theirs = build_pair(cpu_mindformers, tc, seq)
    x = np.random.default_rng(2).standard_normal((b * seq, tc.hidden_size)).astype(np.float32)
    w = ours.gate.weight.asnumpy()
    scores = 1 / (1 + np.exp(-(x @ w.T))) + ours.gate.e_score_correction_bias.asnumpy()
    idx_ours = np.sort(ours.gate(Tensor(x))[0].asnumpy(), -1)
    idx_theirs = np.sort(theirs.router(Tensor(x[None]))[0].asnumpy()[0], -1)
    ds_rule, mf_rule = numpy_route(scores, 6, 4, 2, 2), numpy_route(scores, 6, 4, 2, 3)
    np.testing.assert_array_equal(idx_ours, ds_rule)  # this project: DeepSeek-V3's top-2 group score
    np.testing.assert_array_equal(idx_theirs, mf_rule)  # MindFormers 1.9.0: top-(k / topk_group) group score
    differ = (ds_rule != mf_rule).any(-1)
    assert differ.sum() >= 1, "the chosen inputs must show the difference"
    (vo, _, _), (vt, _, _) = run_both(ours, theirs, b, seq, tc.hidden_size)
    assert abs(float(vt) - float(vo)) > 1e-4 * abs(float(vo))  # so the layers' outputs differ too
    from mindvl_ms.parallel.mindformers_moe import MindFormersSelect

    with pytest.warns(UserWarning, match="ranks groups by their top 3 scores"):
        MindFormersSelect(tc.moe)  # the Ascend path says so when it is built for such a config


def test_ascend_path_mindformers_select_and_dispatcher_equal_ours_on_cpu(cpu_mindformers, agreeing):
    """use_mindformers (what apply_ep binds on Ascend): MindFormers' selection and its all-to-all token
    dispatcher + grouped matmuls inside the Morph, with this project's parameters, on a single device."""
    tc, ours = agreeing.tc, agreeing.ours
    names = [n for n, _ in ours.parameters_and_names()]
    ascend = DeepseekV3MoE(tc)
    for (_, p), (_, q) in zip(ascend.parameters_and_names(), ours.parameters_and_names()):
        p.set_data(Tensor(q.asnumpy()))
    use_mindformers(ascend, tc.moe)
    assert ascend.gate.mindformers_select is not None and ascend.experts.parallel_experts is not None
    assert [n for n, _ in ascend.parameters_and_names()] == names  # no parameter added or renamed
    want = agreeing.got
    got = loss_and_grads(OursLoss(ascend), agreeing.x, agreeing.g, agreeing.valid)
    assert sorted(got[2]) == sorted(want[2])
    for a, c in zip([want[0], want[1]] + [want[2][k] for k in sorted(want[2])],
                    [got[0], got[1]] + [got[2][k] for k in sorted(want[2])]):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-5)


def test_ascend_default_binds_mindformers_moe_without_a_layout(monkeypatch):
    """On Ascend, MindFormers' router and dispatcher are the MoE default also without semi-auto parallel:
    the trainer's prepare_model (train/build.py) binds them on every MoE layer (as `apply_ep` does under a layout); on CPU
    nothing is bound."""
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny-moe.yaml"))
    run = RunConfig()
    model = MindVLModel(cfg)
    moes = [c for _, c in model.cells_and_names() if isinstance(c, DeepseekV3MoE)]
    assert moes
    build.prepare_model(model, run)
    assert all(m.gate.mindformers_select is None and m.experts.parallel_experts is None for m in moes)
    monkeypatch.setattr(build, "is_ascend", lambda: True)
    build.prepare_model(model, run)
    assert all(m.gate.mindformers_select is not None and m.experts.parallel_experts is not None for m in moes)
