"""Strategies declared by mindvl_ms.parallel.moe.shard_moe, read back from the primitives, on the tiny MoE and
on an abstract (no weights allocated) DeepSeek-V3 671B MoE layer; per-parameter shard shapes against
hand-computed ones."""
import os

import numpy as np
import pytest

from mindvl_ms.config import load_model_config
from mindvl_ms.models.moe import DeepseekV3MoE
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.moe import parameter_shards, shard_moe, split_counts, use_mindformers
from tests.support.paths import ROOT

TINY = load_model_config(os.path.join(ROOT, "configs/model/tiny-moe.yaml")).text
BIG = load_model_config(os.path.join(ROOT, "configs/model/mindvl-671b-a37b.yaml")).text


def check_strategies(moe, lay):
    stage = lay.dp * lay.tp
    assert moe.gate.gate_matmul.in_strategy == ((stage, 1), (1, 1))  # tokens over the stage, gate replicated
    ep_cell = moe.experts.parallel_experts
    morph = ep_cell.morph
    for spec in morph.attrs["in_layout"] + morph.attrs["out_layout"]:
        assert tuple(spec["device_matrix"]) == (stage // lay.ep, lay.ep)  # MindFormers' MoE device matrix
    tok, exp = (stage, 1, 1), (lay.ep, 1, 1)
    assert split_counts(morph) == [tok, tok, tok, exp, exp, exp]
    assert ep_cell.dispatcher.ep == lay.ep and ep_cell.dispatcher.expert_num == moe.num_experts
    sh = moe.shared_experts
    assert sh.gate_proj.matmul.in_strategy == ((lay.dp, 1), (lay.tp, 1))
    assert sh.up_proj.matmul.in_strategy == ((lay.dp, 1), (lay.tp, 1))
    assert sh.down_proj.matmul.in_strategy == ((lay.dp, lay.tp), (1, lay.tp))
    out = sh.down_proj.matmul.attrs.get("out_strategy")
    assert (tuple(out) == ((stage, 1),)) if lay.seq_parallel else out is None


def check_shards(moe, lay, e, d, inter, shared_inter):
    shards = parameter_shards(moe)
    expected = {
        "gate.weight": (e, d),
        "experts.gate_proj": (e // lay.ep, d, inter),
        "experts.up_proj": (e // lay.ep, d, inter),
        "experts.down_proj": (e // lay.ep, inter, d),
        "shared_experts.gate_proj.weight": (shared_inter // lay.tp, d),
        "shared_experts.up_proj.weight": (shared_inter // lay.tp, d),
        "shared_experts.down_proj.weight": (d, shared_inter // lay.tp),
    }
    assert {k: v["shard"] for k, v in shards.items()} == expected
    for name, s in shards.items():
        # the distinct pieces tile the full tensor: shard * splits per dim, and element counts add up
        assert tuple(a * b for a, b in zip(s["shard"], s["split"])) == s["full"]
        assert int(np.prod(s["shard"])) * int(np.prod(s["split"])) == int(np.prod(s["full"])), name
    return shards


@pytest.mark.parametrize("lay", [Layout(dp=1, tp=1, ep=1), Layout(dp=2, tp=1, ep=2),
                                 Layout(dp=4, tp=2, ep=8, seq_parallel=True), Layout(dp=2, tp=2, ep=2)])
def test_tiny_moe_strategies_and_shards(lay):
    moe = shard_moe(DeepseekV3MoE(TINY), lay)
    check_strategies(moe, lay)
    m = TINY.moe
    check_shards(moe, lay, m.n_routed_experts, TINY.hidden_size, m.moe_intermediate_size,
                 m.moe_intermediate_size * m.n_shared_experts)


def test_671b_moe_layer_shards_from_the_shipped_layout():
    from mindspore.nn.utils import no_init_parameters

    import yaml

    with open(os.path.join(ROOT, "configs/parallel/ascend-671b-512npu.yaml")) as f:
        p = yaml.safe_load(f)["parallel_config"]  # the shipped 671B layout (a run-config fragment)
    lay = Layout(dp=p["data_parallel"], tp=p["model_parallel"], pp=p["pipeline_stage"], ep=p["expert_parallel"],
                 seq_parallel=p["use_seq_parallel"])
    assert (lay.dp, lay.tp, lay.pp, lay.ep) == (8, 8, 8, 64)
    with no_init_parameters():
        moe = DeepseekV3MoE(BIG)
    shard_moe(moe, lay)
    check_strategies(moe, lay)
    m = BIG.moe
    shards = check_shards(moe, lay, 256, 7168, 2048, 2048)
    assert (m.n_routed_experts, BIG.hidden_size, m.moe_intermediate_size) == (256, 7168, 2048)
    # each rank holds 256 / 64 = 4 routed experts: 4 x 3 x 7168 x 2048 = 176,160,768 expert weights
    routed = sum(int(np.prod(shards[f"experts.{n}"]["shard"])) for n in ("gate_proj", "up_proj", "down_proj"))
    assert routed == 176_160_768
    # an EP group is 64 consecutive ranks inside one pipeline stage of dp x tp = 64 ranks
    assert lay.ep_group(70) == list(range(64, 128))


def test_expert_parallel_must_divide_the_experts():
    with pytest.raises(ValueError, match="must divide the 8 routed experts"):
        shard_moe(DeepseekV3MoE(TINY), Layout(dp=3, tp=1, ep=3))


def test_shard_moe_on_the_mindformers_path_splits_selection_over_the_stage():
    moe = use_mindformers(DeepseekV3MoE(TINY), TINY.moe)
    assert moe.gate.mindformers_select.stage == 1
    lay = Layout(dp=2, tp=2, ep=4)
    shard_moe(moe, lay)
    assert moe.gate.mindformers_select.stage == 4  # [S, T/S, E] view, MindFormers' (dp, N, E)
    assert moe.experts.parallel_experts.dispatcher.ep == 4
