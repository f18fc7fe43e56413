"""`mindvl plan`: the activation formulas against Korthikanti et al. 2022, parameter counts against the real
cells, hand-computed per-device shards, the exit code of a layout that does not fit, and every shipped Ascend
run config fitting its own memory limit."""
import glob
import os

import numpy as np
import pytest

from mindvl_ms.cli import main
from mindvl_ms.config import load_model_config
from mindvl_ms.config.train import load_run_config
from mindvl_ms.parallel.moe_validate import count_parameters
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.plan import (GB, LayerShape, check, korthikanti_layer_bytes, layer_activation_terms,
                                     param_groups, parse_memory, plan_run, stage_layers)

from tests.support.paths import ROOT  # noqa: E402
RUN = os.path.join(ROOT, "configs", "run")
GPT3 = dict(a=96, h=12288)      # GPT-3 175B (the paper's Table 3), s = 2048
MTNLG = dict(a=128, h=20480)    # MT-NLG 530B


def test_paper_figures_from_its_formulas():
    s = 2048
    # section 4.1: the attention term 5as/h is 80 for GPT-3 and 64 for MT-NLG, larger than the 34 of the rest
    assert 5 * GPT3["a"] * s / GPT3["h"] == 80 and 5 * MTNLG["a"] * s / MTNLG["h"] == 64
    # section 4.3: selective recomputation saves 70% (GPT-3) and 65% (MT-NLG) of the activation memory
    for cfg, saved in ((GPT3, 0.70), (MTNLG, 0.65)):
        full = korthikanti_layer_bytes(s, 1, cfg["h"], cfg["a"], t=8, sp=True)
        sel = korthikanti_layer_bytes(s, 1, cfg["h"], cfg["a"], t=8, sp=True, recompute="selective")
        assert round(1 - sel / full, 2) == saved
        # abstract: SP + selective recomputation reduce activation memory by about 5x against TP alone
        base = korthikanti_layer_bytes(s, 1, cfg["h"], cfg["a"], t=8)
        assert round(base / sel) == 5
    # Table 2, written out for GPT-3 at t = 8 (bytes for one layer, b = 1)
    sbh = s * GPT3["h"]
    assert korthikanti_layer_bytes(s, 1, GPT3["h"], GPT3["a"]) == sbh * 114
    assert korthikanti_layer_bytes(s, 1, GPT3["h"], GPT3["a"], t=8) == sbh * (10 + 3 + 10)
    assert korthikanti_layer_bytes(s, 1, GPT3["h"], GPT3["a"], t=8, sp=True) == sbh * 114 / 8
    assert korthikanti_layer_bytes(s, 1, GPT3["h"], GPT3["a"], t=8, recompute="selective") == sbh * 13
    assert korthikanti_layer_bytes(s, 1, GPT3["h"], GPT3["a"], t=8, sp=True, recompute="selective") == sbh * 34 / 8
    assert korthikanti_layer_bytes(s, 1, GPT3["h"], GPT3["a"], t=8, recompute="full") == 2 * sbh


@pytest.mark.parametrize("cfg", [GPT3, MTNLG, dict(a=64, h=6144)])
@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (8, False), (8, True), (4, True)])
@pytest.mark.parametrize("rc", ["none", "selective", "full"])
def test_itemised_terms_reduce_to_the_paper_for_a_gpt_layer(cfg, t, sp, rc):
    h, a, s, b = cfg["h"], cfg["a"], 2048, 2
    gpt = LayerShape(h=h, heads=a, q=h, k=h, v=h, ffn=4 * h, gated=False, flash=False, dropout=True)
    got = sum(layer_activation_terms(gpt, s, b, t, sp, rc).values())
    want = korthikanti_layer_bytes(s, b, h, a, t, sp, rc)
    if rc == "full" and sp:
        want /= t  # the layer input is split over the TP group under sequence parallel
    assert got == pytest.approx(want, rel=1e-12)


def _by_component(named_shapes):
    out = {}
    for name, n in named_shapes:
        key = ("projector" if name.startswith("visual.merger.") else "vision" if name.startswith("visual.") else
               "embedding" if name.startswith("model.embed_tokens.") else "lm_head" if name.startswith("lm_head.")
               else "final norm" if name.startswith("model.norm.") else "MTP" if name.startswith("model.mtp.")
               else "decoder layers")
        out[key] = out.get(key, 0) + n
    return out


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny-moe.yaml", "mindvl-8b.yaml", "openpangu-vl-7b.yaml"])
def test_parameter_groups_equal_the_cells(name):
    from mindspore.nn.utils import no_init_parameters

    from mindvl_ms.models.mindvl import MindVLModel

    cfg = load_model_config(os.path.join(ROOT, "configs", "model", name))
    with no_init_parameters():
        model = MindVLModel(cfg)
    real = _by_component((p.name, int(np.prod(p.shape))) for p in model.get_parameters())
    groups = param_groups(cfg, Layout())
    mine = {}
    for g in groups:
        key = "decoder layers" if g.name == "routed experts" else g.name
        mine[key] = mine.get(key, 0) + g.count
    assert mine == real
    for i in (0, cfg.text.num_hidden_layers - 1):  # each layer's groups hold exactly that layer's parameters
        layer = sum(int(np.prod(p.shape)) for p in model.get_parameters() if p.name.startswith(f"model.layers.{i}."))
        assert sum(g.count for g in groups if g.layer == i) == layer


def test_671b_groups_match_count_parameters():
    text = load_model_config(os.path.join(ROOT, "configs", "model", "mindvl-671b-a37b.yaml")).text
    c = count_parameters(text)
    groups = param_groups(load_model_config(os.path.join(ROOT, "configs", "model", "mindvl-671b-a37b.yaml")),
                          Layout(dp=8, tp=8, pp=8, ep=64))
    llm = sum(g.count for g in groups if g.name not in ("vision", "projector", "MTP"))
    assert llm == c["total"] and sum(g.count for g in groups if g.name == "MTP") == c["mtp"]
    assert sum(g.count for g in groups if g.name == "routed experts") == c["routed_experts"]


def test_hand_computed_shards_8b_tp4():
    """One Qwen3-8B decoder layer at TP 4: q/o 4096x4096, k/v 4096x1024, gate/up/down 4096x12288 split by 4;
    two 4096 norms and two 128 QK-norms replicated. Weights fp32, + gradients 8 B, + Adam 8 B per element."""
    cfg = load_run_config(os.path.join(RUN, "mindvl-8b-64npu.yaml"), ["parallel.enable_parallel_optimizer=false"])
    split = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288) // 4
    rep = 2 * 4096 + 2 * 128
    layers = 36 * (split + rep)
    vit = 32 * (2 * 1280 + 3 * 1280 * 1280 + 3 * 1280 + 1280 * 1280 + 1280 + 2 * (1280 * 3456 + 3456) + 3456 * 1280
                 + 1280) + 3 * 2 * 14 * 14 * 1280
    proj = 1280 + 5120 * 5120 + 5120 + 5120 * 4096 + 4096
    rest = 2 * 151936 * 4096 + 4096  # embedding and lm_head replicated (vocab_emb_dp), final norm
    elems = layers + vit + proj + rest
    d = {x.training_stage: x for x in plan_run(cfg)}
    assert d["multitask"].memory["weights"] == 4 * elems
    assert d["multitask"].memory["gradients"] == 8 * elems
    assert d["multitask"].memory["optimizer states"] == 8 * elems
    # warm-up trains only the projector: every other weight is frozen (no gradient, no Adam state)
    assert d["warmup"].memory["gradients"] == 8 * proj and d["warmup"].memory["optimizer states"] == 8 * proj
    # parallel optimizer: a TP-split weight has dp = 16 copies, a replicated one 64
    cfg.parallel.enable_parallel_optimizer = True
    po = {x.training_stage: x for x in plan_run(cfg)}["multitask"]
    split_e, rep_e = 36 * split, elems - 36 * split
    assert po.memory["optimizer states"] == pytest.approx(8 * split_e / 16 + 8 * rep_e / 64)
    assert po.memory["weights"] == pytest.approx(4 * split_e / 16 + 4 * rep_e / 64 + 2 * elems)


def test_pipeline_layers_and_in_flight_micro_batches():
    assert [len(r) for r in stage_layers(61, 8, [0, 1, 1, 1, 1, 1, 0, 0])] == [7, 8, 8, 8, 8, 8, 7, 7]
    cfg = load_run_config(os.path.join(RUN, "mindvl-671b-512npu.yaml"))
    cfg.recompute_config.recompute = False
    plans = [p for p in plan_run(cfg) if p.training_stage == "sft"]
    # stages 1..5 hold 8 MoE layers each; 1F1B keeps pp - i micro-batches in flight: 7, 6, 5, 4, 3
    per = [plans[i].memory["activations"] / (8 - i) for i in range(1, 6)]
    assert np.allclose(per, per[0], rtol=1e-12)
    assert "EP all-to-all" in plans[1].comm and "PP send/recv" in plans[1].comm


def test_too_small_layout_exits_nonzero_naming_the_component(capsys):
    cfg = os.path.join(RUN, "mindvl-8b-64npu.yaml")
    assert main(["plan", "--config", cfg, "--set", "context.max_device_memory=20GB"]) == 1
    err = capsys.readouterr().err
    assert "does not fit: training stage 'multitask'" in err and "largest: gradients" in err
    assert "decoder layers" in err
    # activations dominate without recompute at 131k tokens on TP 2
    assert main(["plan", "--config", os.path.join(RUN, "openpangu-vl-7b-64npu.yaml"), "--set",
                 "recompute_config.recompute=false", "--set", "parallel_config.model_parallel=2",
                 "--set", "parallel_config.data_parallel=32"]) == 1
    assert "largest: activations" in capsys.readouterr().err
    # a layout the strategy validation refuses never reaches the plan
    assert main(["plan", "--config", cfg, "--set", "parallel_config.model_parallel=3"]) == 2
    assert "not divisible by 3" in capsys.readouterr().err


def test_config_fields_change_the_plan(capsys):
    cfg = load_run_config(os.path.join(RUN, "mindvl-8b-64npu.yaml"))
    cfg.stages[-1].loss.logits_chunk_tokens = 4096
    a = plan_run(cfg)[-1]
    cfg.stages[-1].loss.logits_chunk_tokens = 1024
    b = plan_run(cfg)[-1]
    assert a.memory["logits chunk"] == 4 * b.memory["logits chunk"] == 8 * 4096 * 151936
    dp = plan_run(cfg)[-1]
    cfg.parallel_config.vision_parallel = "tp"
    tp = plan_run(cfg)[-1]
    assert tp.memory["weights"] < dp.memory["weights"]  # the ViT's linears split by 4 instead of replicated
    assert parse_memory("58GB") == 58 * GB and parse_memory("512MB") == 0.5 * GB and parse_memory("") is None


SHIPPED = sorted(glob.glob(os.path.join(RUN, "*.yaml")))


def test_every_shipped_parallel_layout_has_a_run_config():
    included = "".join(open(f).read() for f in SHIPPED)
    for f in glob.glob(os.path.join(ROOT, "configs", "parallel", "ascend-*.yaml")):
        assert os.path.basename(f) in included, f
    assert len(SHIPPED) >= 3


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_ascend_run_configs_fit(path, capsys):
    assert main(["plan", "--config", path]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "NO" not in out.split() and "limit 58.0 GB" in out
    cfg = load_run_config(path)
    assert cfg.context.device_target == "Ascend"
    limit = parse_memory(cfg.context.max_device_memory)
    plans = plan_run(cfg)
    assert not check(cfg, plans, limit) and max(p.total for p in plans) < limit


def test_dryrun_script_simulates_one_rank_per_pipeline_stage():
    import subprocess
    import sys

    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = [os.path.join(ROOT, "scripts", "dryrun.sh"), "--list", os.path.join(RUN, "mindvl-671b-512npu.yaml"),
           "--set", "stages.0.max_steps=1", "--out", "x y"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split()[2] for line in out] == [f"RANK_ID={64 * s}" for s in range(8)]
    assert all(line.startswith("MS_SIMULATION_LEVEL=1 RANK_SIZE=512 ") for line in out)
    assert all(line.endswith(r"--set stages.0.max_steps=1 --out x\ y") for line in out)  # "$@" passed through


def test_hand_computed_activations_and_dp_reduce_8b():
    """MindVL-8B, s 8192, b 1, TP 4 with SP, full recompute: 36 stored layer inputs 2sbh/t plus one layer
    recomputed: outside TP 8sbh/t, inside (2(q+k) + 2v + 2v + 2(q+k) QK-norm + 6f) sb/t with q 4096,
    k = v 1024, f 12288, and FlashAttention's softmax statistics 64 a s b / t."""
    cfg = load_run_config(os.path.join(RUN, "mindvl-8b-64npu.yaml"), ["parallel.enable_parallel_optimizer=false"])
    d = {x.training_stage: x for x in plan_run(cfg)}["sft"]
    s, h, t = 8192, 4096, 4
    stored = 36 * 2 * s * h / t
    work = 8 * s * h / t + (2 * 5120 + 2048 + 2048 + 2 * 5120 + 6 * 12288) * s / t + 64 * 32 * s / t
    assert d.memory["activations"] == pytest.approx(stored + work, rel=1e-12)
    # DP gradient all-reduce of fp32 gradients: TP-split weights over dp = 16 copies, replicated ones over 64
    split = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288) // 4
    total = d.memory["weights"] / 4
    assert d.comm["DP gradient reduce"] == pytest.approx(2 * 15 / 16 * 4 * split + 2 * 63 / 64 * 4 * (total - split))
    # TP: per layer and micro-batch 2 collectives forward, 2 backward, 2 in the recomputed forward,
    # each moving 2(t-1)/t of 2sbh bytes; sft: 512 rows / 16 ranks = 32 micro-batches
    assert d.comm["TP all-gather/reduce-scatter"] == pytest.approx(36 * 32 * 6 * 2 * 3 / 4 * 2 * s * h)


def test_frozen_vit_keeps_one_block():
    cfg = load_run_config(os.path.join(RUN, "mindvl-8b-64npu.yaml"))
    d = {x.training_stage: x for x in plan_run(cfg)}
    vit = LayerShape(h=1280, heads=16, q=1280, k=1280, v=1280, ffn=3456)
    # the visual budget is data.max_image_tokens, 0 = the stage's seq_length; 4 patches per merged token; with
    # vision_parallel dp every TP rank encodes all of them
    w, m = cfg.stages[0], cfg.stages[1]
    assert cfg.data.max_image_tokens == 0 and cfg.parallel_config.vision_parallel == "dp"
    one = sum(layer_activation_terms(vit, w.seq_length * 4, 1).values())
    assert d["warmup"].memory["ViT activations"] == one  # only the projector trains
    one_m = sum(layer_activation_terms(vit, m.seq_length * 4, 1).values())
    full = sum(layer_activation_terms(vit, m.seq_length * 4, 1, recompute="full").values())
    assert d[m.name].memory["ViT activations"] == pytest.approx(32 * full + one_m)  # 32 blocks + one recomputed


def test_hand_computed_expert_shards_671b():
    """EP 64 over a stage's 64 devices: 4 of 256 experts (3 x 7168 x 2048 each) per device and layer, one copy
    of each, so the parallel optimizer has nothing to shard them over: 4 + 8 + 8 bytes per element."""
    cfg = load_run_config(os.path.join(RUN, "mindvl-671b-512npu.yaml"))
    stage1 = [p for p in plan_run(cfg) if p.training_stage == "sft"][1]  # layers 7..14, all MoE
    assert stage1.detail["routed experts"] == 20 * 8 * 4 * 3 * 7168 * 2048
    # the MLA attention of those layers: q_b, kv_b, o and the shared expert split by TP 8 over dp 8 copies;
    # q_a, kv_a, their norms, the layer norms and the router replicated over 64 copies
    split = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168 + 3 * 7168 * 2048
    rep = 7168 * 576 + 512 + 7168 * 1536 + 1536 + 2 * 7168 + 256 * 7168 + 256
    e = 8 * (split / 8), 8 * rep
    want = sum(4 * x / n + 2 * x + 4 * x / n + 4 * x + 8 * x / n for x, n in zip(e, (8, 64)))
    assert stage1.detail["decoder layers"] == pytest.approx(want)
