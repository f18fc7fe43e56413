"""Strategy audit: semi-auto graphs cannot compile on CPU, so the strategies `parallelize` declares are read
back from the primitives and compared with MindFormers' conventions written out by hand here (the
expected tuples below are the convention, not a copy of mindvl_ms/parallel/strategies.py).

Models: abstract (no_init_parameters) MindVL-8B and MindVL-671B-A37B, tiny dense and tiny MoE.
Printed (pytest -s): primitives with a strategy vs without, per model and layout.
"""
import math
import re

import pytest
from mindspore import nn
from mindspore.nn.utils import no_init_parameters
from mindspore.ops import Primitive

from mindvl_ms.config import load_model_config
from mindvl_ms.config.train import load_run_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import Layout, parallelize
from mindvl_ms.parallel.audit import layout_splits, parameter_shards, primitive_census, split_of, strategy_of


def _abstract(path):
    cfg = load_model_config(path)
    with no_init_parameters():
        return cfg, MindVLModel(cfg)


@pytest.fixture(scope="module")
def model_8b():
    return _abstract("configs/model/mindvl-8b.yaml")


def _prims(model, prim_name, llm_only=True):
    for name, cell in model.cells_and_names():
        if llm_only and name.startswith(("visual", "merge")):  # the ViT and its merge: test_vision_parallel
            continue
        for attr, p in cell._primitives.items():
            if isinstance(p, Primitive) and p.name == prim_name:
                yield f"{name}.{attr}", cell, p


def _expected_llm_matmul(name, dp, tp, sp, vocab_tp):
    """MindFormers: column ((dp,1),(tp,1)); row ((dp,tp),(1,tp)) [+ out ((dp*tp,1),) with seq parallel];
    MLA down-projections replicated ((dp,1),(1,1)); lm_head ((dp,1),(tp|1,1))."""
    if re.search(r"(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.matmul$", name):
        return ((dp, 1), (tp, 1)), None
    if re.search(r"(o_proj|down_proj)\.matmul$", name):
        return ((dp, tp), (1, tp)), (((dp * tp, 1),) if sp else None)
    if re.search(r"(q_a_proj|kv_a_proj_with_mqa|eh_proj)\.matmul$", name):
        return ((dp, 1), (1, 1)), None
    if re.search(r"(lm_head|tied_head)\.matmul$", name):
        return ((dp, 1), (vocab_tp, 1)), None
    raise AssertionError(f"no convention for {name}")


def _audit_llm(model, dp, tp, sp, vocab_tp):
    n = 0
    for name, _, p in _prims(model, "MatMul"):
        if ".mlp.gate." in name or ".mlp.experts." in name:  # MoE router / routed experts: parallel/moe.py
            continue
        if ".shared_experts." in name and strategy_of(p) is None:  # MoE cell not sharded (no parallel/moe.py)
            continue
        want_in, want_out = _expected_llm_matmul(name, dp, tp, sp, vocab_tp)
        assert strategy_of(p) == want_in, name
        assert p.attrs.get("out_strategy") == want_out, name
        n += 1
    gathers = list(_prims(model, "Gather"))
    assert [strategy_of(p) for _, _, p in gathers] == [((vocab_tp, 1), (dp, 1))]
    for name, _, p in _prims(model, "FlashAttentionScore"):  # present once ops/attention.py holds it
        assert strategy_of(p) is not None, name
    return n


MOE_INTERNALS = r"\.mlp\.(experts|gate)(\.|$)"  # router and routed experts (parallel/moe.py's Morph)


def _census(tag, model, prefix=""):
    c = primitive_census(model, prefix)
    w, wo = sum(c["with"].values()), sum(c["without"].values())
    print(f"\n[audit] {tag}: {w} primitives with a strategy, {wo} without; without by type {dict(c['without'])}")
    rest = primitive_census(model, prefix, exclude=MOE_INTERNALS)
    print(f"[audit] {tag} outside the router/routed experts: {sum(rest['with'].values())} with, "
          f"{sum(rest['without'].values())} without")
    return w, wo, c


@pytest.mark.parametrize("dp,tp,sp,vocab_dp", [(64, 1, False, True), (16, 4, False, True), (16, 4, True, False)])
def test_8b_llm_strategies(model_8b, dp, tp, sp, vocab_dp):
    cfg, m = model_8b
    for layer in m.model.layers:
        layer.mlp.glu.fused = True  # as on Ascend
    rep = parallelize(m, Layout(dp=dp, tp=tp, seq_parallel=sp, vocab_emb_dp=vocab_dp))
    vocab_tp = 1 if vocab_dp else tp
    assert rep.vocab_split == vocab_tp
    n = _audit_llm(m, dp, tp, sp, vocab_tp)
    assert n == 36 * 7 + 1  # q k v o gate up down per layer + lm_head
    hid = (dp, tp if sp else 1, 1)
    layer = m.model.layers[5]
    assert strategy_of(layer.input_layernorm.rms_norm) == (hid, (1,))
    assert strategy_of(layer.post_attention_layernorm.mean) == (hid,)
    assert strategy_of(m.model.norm.rms_norm) == (hid, (1,))
    assert strategy_of(layer.add) == (hid, hid)                        # residual adds
    assert strategy_of(layer.self_attn.q_norm.rms_norm) == ((dp, 1, tp, 1), (1,))
    assert split_of(layer.self_attn.rotary.rope) == ((dp, tp, 1, 1), (dp, 1, 1, 1), (dp, 1, 1, 1))
    assert strategy_of(layer.mlp.glu.silu) == ((dp, 1, tp),)
    assert layer.mlp.glu.fused is (tp == 1)  # the fused kernel's concat cannot take a split FFN dim
    _, wo, _ = _census(f"8B dp{dp} tp{tp} sp{sp} vocab_dp{vocab_dp}", m, "model.")


def test_8b_shard_shapes_add_up(model_8b):
    cfg, m = model_8b
    parallelize(m, Layout(dp=16, tp=4, seq_parallel=True, vocab_emb_dp=False), vision_parallel="tp")
    shards = parameter_shards(m)
    for name, (full, split, shard) in shards.items():
        assert shard is not None, (name, full, split)
        assert math.prod(shard) * math.prod(split) == math.prod(full), name
    t = cfg.text
    qd = t.num_attention_heads * t.head_dim
    assert shards["model.layers.0.self_attn.q_proj.weight"][2] == (qd // 4, t.hidden_size)
    assert shards["model.layers.0.self_attn.o_proj.weight"][2] == (t.hidden_size, qd // 4)
    assert shards["model.layers.0.mlp.down_proj.weight"][2] == (t.hidden_size, t.intermediate_size // 4)
    assert shards["model.embed_tokens.weight"][2] == (t.vocab_size // 4, t.hidden_size)
    assert shards["lm_head.weight"][2] == (t.vocab_size // 4, t.hidden_size)
    assert shards["visual.blocks.0.attn.qkv.weight"][2] == (3 * cfg.vision.hidden_size // 4, cfg.vision.hidden_size)
    # every matrix of the model has a declared split
    mats = {p.name for p in m.get_parameters() if len(p.shape) == 2}
    assert mats <= set(shards), sorted(mats - set(shards))[:5]
    w, wo, _ = _census("8B whole model dp16 tp4 sp vision tp", m)
    assert wo == 0


@pytest.mark.parametrize("vp,rows,split", [("dp", 64, 1), ("tp", 16, 4)])
def test_vision_parallel(model_8b, vp, rows, split):
    """vision_parallel tp: the LLM's column/row split over 16 dp x 4 tp; dp: whole weights, the patches of
    every rank's own share of its TP group's images split over all 64 ranks (parallel/vit_balance.py)."""
    cfg, m = model_8b
    parallelize(m, Layout(dp=16, tp=4), vision_parallel=vp)
    blk = m.visual.blocks[0]
    assert strategy_of(blk.attn.qkv.matmul) == ((rows, 1), (split, 1))
    assert strategy_of(blk.attn.proj.matmul) == ((rows, split), (1, split))
    assert strategy_of(blk.mlp.down_proj.matmul) == ((rows, split), (1, split))
    assert strategy_of(m.visual.merger.mlp[0].matmul) == ((rows, 1), (split, 1))
    assert strategy_of(m.visual.patch_embed.proj.matmul) == ((rows, 1), (1, 1))
    assert strategy_of(blk.norm1.rms_norm) == ((rows, 1), (1,))
    if vp == "dp":  # each DP group's text rows and all-gathered shares, gathered per group
        assert type(m.merge).__name__ == "GroupMerge"
        assert strategy_of(m.merge.gather) == ((16, 1, 1), (16, 1))
        assert strategy_of(m.merge.concat) == ((16, 1, 1), (16, 1, 1))


def test_671b_moe_llm_strategies():
    cfg, m = _abstract("configs/model/mindvl-671b-a37b.yaml")
    run = load_run_config("configs/run/mindvl-671b-512npu.yaml")  # the shipped layout: dp 8, tp 8, pp 8, ep 64
    lay, offset = Layout.from_run_config(run), run.parallel_config.offset
    assert (lay.dp, lay.tp, lay.pp, lay.ep, lay.seq_parallel) == (8, 8, 8, 64, True)
    n_layers = cfg.text.num_hidden_layers
    rep = parallelize(m, lay, offset=offset)
    n = _audit_llm(m, 8, 8, True, 1)
    dense_layers = cfg.text.moe.first_k_dense_replace
    mtp = cfg.text.moe.num_nextn_predict_layers
    # MLA: q_a, q_b, kv_a, kv_b, o per layer; dense MLP: 3; shared experts (MoE layers and MTP): 3;
    # MTP eh_proj; lm_head
    assert n == 5 * (n_layers + mtp) + 3 * dense_layers + 3 * (n_layers - dense_layers + mtp) + mtp + 1
    attn = m.model.layers[10].self_attn
    assert split_of(attn.rotary.rope)[0] == (8, 8, 1, 1)
    assert split_of(attn.rotary_k.rope)[0] == (8, 1, 1, 1)   # the one shared rope key: no head split
    assert strategy_of(attn.kv_a_layernorm.rms_norm) == ((8, 1, 1), (1,))
    assert sorted(set(rep.delegated.values())) == ["attention", "moe"]
    for name, (full, split, shard) in parameter_shards(m).items():
        assert shard is not None and math.prod(shard) * math.prod(split) == math.prod(full), name
    _, _, c = _census("671B-A37B LLM dp8 tp8 pp8 ep64 sp (shipped 512-NPU layout)", m, "model.")
    assert sum(primitive_census(m, "model.", exclude=MOE_INTERNALS)["without"].values()) == 0


def test_tiny_models_every_primitive_audited():
    """Tiny dense (tied head) and tiny MoE, built with real weights: LLM strategies as the convention."""
    for path in ("configs/model/tiny.yaml", "configs/model/tiny-moe.yaml"):
        cfg = load_model_config(path)
        m = MindVLModel(cfg)
        parallelize(m, Layout(dp=2, tp=2, seq_parallel=True, vocab_emb_dp=False))
        vocab_tp = 2 if cfg.text.vocab_size % 2 == 0 else 1
        assert _audit_llm(m, 2, 2, True, vocab_tp) > 0
        _census(f"{path} dp2 tp2 sp", m)


def test_nn_dense_in_llm_all_matched(model_8b):
    cfg, m = model_8b
    rep = parallelize(m, Layout(dp=8, tp=8))
    assert rep.unmatched_linear == []
    dense = [n for n, c in m.cells_and_names() if isinstance(c, nn.Dense)]
    assert sorted(dense) == sorted(rep.linear)


def test_fused_rope_self_defined_shard_as_mindformers():
    """The fused RotaryPositionEmbedding as MindFormers 1.9's ApplyRotaryPosEmb.shard: self_define_shard, Layouts
    over (dp, tp) for x, cos, sin and for the output (laid out as x); the shared MLA rope key and the ViT
    (vision_parallel dp: heads whole, patches split over dp x tp, every rank its own share) get theirs."""
    cfg = load_model_config("configs/model/tiny.yaml")
    m = MindVLModel(cfg)
    parallelize(m, Layout(dp=2, tp=2), vision_parallel="dp")
    rope = m.model.layers[0].self_attn.rotary.rope
    assert rope.attrs["self_define_shard"] is True
    assert layout_splits(rope.attrs["in_layout"]) == ((2, 2, 1, 1), (2, 1, 1, 1), (2, 1, 1, 1))
    assert layout_splits(rope.attrs["out_layout"]) == ((2, 2, 1, 1),)
    assert rope.attrs["in_layout"][0]["device_matrix"] == (2, 2)
    assert rope.attrs["in_layout"][0]["alias_name"] == ("dp", "tp")
    vit = m.visual.blocks[0].attn.rotary.rope
    assert vit.attrs["self_define_shard"] is True
    assert layout_splits(vit.attrs["in_layout"]) == ((1, 1, 4, 1), (1, 1, 4, 1), (1, 1, 4, 1))
    moe = MindVLModel(load_model_config("configs/model/tiny-moe.yaml"))
    parallelize(moe, Layout(dp=2, tp=2))
    attn = next(layer.self_attn for layer in moe.model.layers if hasattr(layer.self_attn, "rotary_k"))
    assert layout_splits(attn.rotary_k.rope.attrs["in_layout"])[0] == (2, 1, 1, 1)
    assert layout_splits(attn.rotary.rope.attrs["out_layout"]) == ((2, 2, 1, 1),)


def test_a_primitive_let_go_is_not_counted():
    """A cell that sets a primitive attribute to None (a `drop_kernel`) lets go of it, though MindSpore keeps
    the entry in the cell's primitive table: the census counts only what the cell still holds."""
    from mindspore import nn, ops

    from mindvl_ms.parallel.audit import iter_primitives

    class TwoOps(nn.Cell):
        def __init__(self):
            super().__init__()
            self.kept, self.dropped = ops.MatMul(), ops.Exp()

    cell = TwoOps()
    assert sorted(a for _, a, _ in iter_primitives(cell)) == ["dropped", "kept"]
    cell.dropped = None
    assert "dropped" in cell._primitives  # pylint: disable=protected-access
    assert [a for _, a, _ in iter_primitives(cell)] == ["kept"]
    assert primitive_census(cell)["without"] == {"MatMul": 1}
