"""Every parallel / recompute / context knob changes something observable (one test per knob), and the
rank coordinates reach the loader and the gradient-reduction flag."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, context
from mindspore._c_expression import ms_ctx_param
from mindspore.nn.utils import no_init_parameters
from mindspore.ops import Primitive

from mindvl_ms.config import load_model_config
from mindvl_ms.config.base import ConfigError
from mindvl_ms.config.train import load_run_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import Layout, apply_recompute, assign_pipeline_stages, layer_stages, parallelize
from mindvl_ms.parallel.audit import strategy_of
from mindvl_ms.parallel import runtime as D

from tests.support.paths import ROOT  # noqa: E402


def run_cfg(model="tiny.yaml", **sections):
    data = {"model": os.path.join(ROOT, "configs/model", model), "stages": [{"name": "s", "max_steps": 1}]}
    data.update(sections)
    return load_run_config(data=data)


def abstract(model="tiny.yaml"):
    cfg = load_model_config(os.path.join(ROOT, "configs/model", model))
    with no_init_parameters():
        return MindVLModel(cfg)


def test_use_seq_parallel():
    outs = {}
    for sp in (False, True):
        m = abstract()
        parallelize(m, run_cfg(parallel_config={"data_parallel": 2, "model_parallel": 2, "use_seq_parallel": sp}))
        layer = m.model.layers[0]
        outs[sp] = (layer.self_attn.o_proj.matmul.attrs.get("out_strategy"),
                    layer.mlp.down_proj.matmul.attrs.get("out_strategy"),
                    strategy_of(layer.input_layernorm.rms_norm)[0], strategy_of(layer.add)[0])
    assert outs[False] == (None, None, (2, 1, 1), (2, 1, 1))
    assert outs[True] == (((4, 1),), ((4, 1),), (2, 2, 1), (2, 2, 1))   # reduce-scatter onto the tokens


def test_vocab_emb_dp():
    for vocab_dp, want in ((True, 1), (False, 2)):
        m = abstract()
        parallelize(m, run_cfg(parallel_config={"data_parallel": 2, "model_parallel": 2, "vocab_emb_dp": vocab_dp}))
        assert strategy_of(m.model.embed_tokens.gather) == ((want, 1), (2, 1))
        assert strategy_of(m.tied_head.matmul) == ((2, 1), (want, 1))
    m = abstract("tiny-moe.yaml")  # vocab 151669 is odd: not split by tp 2 even with vocab_emb_dp false
    rep = parallelize(m, Layout(dp=2, tp=2, vocab_emb_dp=False))
    assert rep.vocab_split == 1 and strategy_of(m.lm_head.matmul) == ((2, 1), (1, 1))


def test_vision_parallel_field():
    for vp, rows, split in (("dp", 4, 1), ("tp", 2, 2)):  # dp: each rank of a TP group its own images
        m = abstract()
        parallelize(m, run_cfg(parallel_config={"data_parallel": 2, "model_parallel": 2, "vision_parallel": vp}))
        assert strategy_of(m.visual.blocks[0].mlp.gate_proj.matmul) == ((rows, 1), (split, 1))
    with pytest.raises(ConfigError, match="vision_parallel"):
        run_cfg(parallel_config={"vision_parallel": "ep"})


def test_offset_pipeline_stages():
    assert layer_stages(10, 4, [1, 1, 0, 0]) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert layer_stages(8, 2) == [0] * 4 + [1] * 4
    with pytest.raises(ConfigError, match="offset"):
        layer_stages(10, 4, [1, 0, 0])
    with pytest.raises(ConfigError, match="set parallel_config.offset"):
        layer_stages(10, 4)
    m = abstract("mindvl-8b.yaml")  # 36 layers, untied head
    rep = parallelize(m, run_cfg("mindvl-8b.yaml", parallel_config={
        "data_parallel": 2, "model_parallel": 2, "pipeline_stage": 4, "offset": [1, 0, 0, -1]}))
    stages = [layer.pipeline_stage for layer in m.model.layers]
    assert stages == [0] * 10 + [1] * 9 + [2] * 9 + [3] * 8
    assert (m.model.embed_tokens.pipeline_stage, m.visual.pipeline_stage) == (0, 0)
    assert (m.model.norm.pipeline_stage, m.lm_head.pipeline_stage) == (3, 3)
    assert rep.stages["layers.10"] == 1
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        assign_pipeline_stages(abstract(), 2)


def test_micro_batch_num_is_not_a_config_field():
    """The pipeline's micro-batch count follows from each stage (train.mf_step.micro_batch_num); a config that
    still sets it is refused by name rather than silently ignored."""
    with pytest.raises(ConfigError, match="micro_batch_num"):
        run_cfg("mindvl-8b.yaml", parallel_config={"data_parallel": 2, "pipeline_stage": 4, "micro_batch_num": 8})


def test_gradient_aggregation_group():
    for group, want_last in ((4, 9), (12, 3)):
        m = abstract("mindvl-8b.yaml")
        parallelize(m, run_cfg("mindvl-8b.yaml", parallel_config={"gradient_aggregation_group": group}))
        fusion = [{p.comm_fusion for p in layer.trainable_params()} for layer in m.model.layers]
        assert fusion[0] == {1} and fusion[group - 1] == {1} and fusion[group] == {2} and fusion[-1] == {want_last}


def _layer_prims(layer):
    for _, cell in layer.cells_and_names():
        for p in cell._primitives.values():
            if isinstance(p, Primitive):
                yield p


def _recompute_cfg(**kw):
    return run_cfg(recompute_config=kw).recompute_config


def test_recompute_full_and_comm_flags():
    m = abstract()
    counts = apply_recompute(m, _recompute_cfg(recompute=True, mp_comm_recompute=False,
                                               recompute_slice_activation=True))
    assert counts == {"full_cells": 4, "select_primitives": 0}  # 2 decoder layers + 2 ViT blocks
    layer = m.model.layers[1]
    assert layer._has_config_recompute and m.visual.blocks[0]._has_config_recompute
    assert not m.model.norm._has_config_recompute
    prims = list(_layer_prims(layer))
    assert {p.attrs.get("recompute_comm_op") for p in prims} == {False}
    assert {p.attrs.get("slice_activation") for p in prims} == {True}
    m2 = abstract()
    apply_recompute(m2, _recompute_cfg(recompute=True))  # defaults: mp_comm_recompute true, no slicing
    prims = list(_layer_prims(m2.model.layers[1]))
    assert {p.attrs.get("recompute_comm_op") for p in prims} == {True}
    assert {p.attrs.get("slice_activation") for p in prims} == {False}


def test_select_recompute():
    m = abstract()
    counts = apply_recompute(m, _recompute_cfg(select_recompute=True))
    assert counts["select_primitives"] > 0 and not m.model.layers[0]._has_config_recompute
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    assert attn.rotary.mul_cos.attrs.get("recompute") is True
    assert attn.core.softmax.attrs.get("recompute") is True and attn.core.fa.attrs.get("recompute") is True
    assert mlp.glu.silu.attrs.get("recompute") is True and mlp.glu.mul.attrs.get("recompute") is True
    assert "recompute" not in attn.q_proj.matmul.attrs and "recompute" not in mlp.down_proj.matmul.attrs
    m2 = abstract()
    assert apply_recompute(m2, _recompute_cfg()) == {"full_cells": 0, "select_primitives": 0}
    assert "recompute" not in m2.model.layers[0].mlp.glu.silu.attrs


def test_jit_level():
    cfg = run_cfg(context={"device_target": "Ascend", "jit_level": "O1", "max_device_memory": "58GB"})
    assert D.context_settings(cfg.context) == {"jit_config": {"jit_level": "O1"}, "max_device_memory": "58GB"}
    assert D.context_settings(run_cfg().context) == {}  # CPU: MindSpore's default compile level
    from mindspore import context
    from mindspore._c_expression import ms_ctx_param

    ctx = context._context()
    before, level = dict(ctx.jit_config), ctx.get_param(ms_ctx_param.jit_level)
    try:  # what setup() does with the settings, read back from MindSpore's context
        ms.set_context(**{"jit_config": D.context_settings(cfg.context)["jit_config"]})
        assert ms.get_context("jit_config")["jit_level"] == "O1"
        assert ctx.get_param(ms_ctx_param.jit_level) == "O1"
    finally:  # restore the default so later tests compile as before
        ctx.set_param(ms_ctx_param.jit_level, level)
        ctx.jit_config = before
    with pytest.raises(ConfigError, match="jit_level"):
        run_cfg(context={"jit_level": "O3"})


SPEED_UP = {  # context.parallel_speed_up field (MindSpore's JSON key) -> (value set, context parameter, read back)
    "grad_matmul_communication_overlap": (True, "matmul_grad_comm_overlap",
                                          "AlltoAll,AlltoAllV,AllGather,ReduceScatter,AllReduce"),
    "recomputation_communication_overlap": (True, "recompute_comm_overlap",
                                            "AlltoAll,AlltoAllV,AllGather,ReduceScatter,AllReduce"),
    "grad_fa_allgather_overlap": (True, "recompute_allgather_overlap_fagrad", True),
    "computation_communication_fusion_level": (3, "compute_communicate_fusion_level", 3),
    "allreduce_and_biasadd_swap": (True, "bias_add_comm_swap", True),
    "grad_computation_allreduce_overlap": (True, "enable_grad_comm_opt", True),
    "computation_allgather_overlap": (True, "enable_opt_shard_comm_opt", True),
}


def test_parallel_speed_up_reaches_the_context(monkeypatch):
    """Each `context.parallel_speed_up` switch, read back from MindSpore's context after the call setup() makes.
    set_context ignores `ascend_config` unless the device is Ascend, so its device filter is bypassed for the
    call; the values still go through set_context's own reading of the JSON file and its setters."""
    on = {k: v for k, (v, _, _) in SPEED_UP.items()}
    cfg = run_cfg(context={"device_target": "Ascend", "parallel_speed_up": on})
    assert D.parallel_speed_up(cfg.context) == on
    assert D.parallel_speed_up(run_cfg(context={"parallel_speed_up": on}).context) == {}  # CPU: not applied
    assert D.parallel_speed_up(run_cfg(context={"device_target": "Ascend"}).context) == {}  # all off: defaults
    assert D.apply_parallel_speed_up(run_cfg().context) == ""
    with pytest.raises(ConfigError, match="computation_communication_fusion_level"):
        run_cfg(context={"parallel_speed_up": {"computation_communication_fusion_level": 4}})
    ctx = context._context()
    params = {k: getattr(ms_ctx_param, p) for k, (_, p, _) in SPEED_UP.items()}
    before, ascend_config = {k: ctx.get_param(p) for k, p in params.items()}, ctx.ascend_config
    assert all(before[k] != want for k, (_, _, want) in SPEED_UP.items())
    monkeypatch.setattr(context, "_check_target_specific_cfgs", lambda device, key: True)
    try:
        path = D.apply_parallel_speed_up(cfg.context)
        with open(path, encoding="utf-8") as f:
            assert json.load(f) == on
        assert ms.get_context("ascend_config") == {"parallel_speed_up_json_path": path}
        assert {k: ctx.get_param(p) for k, p in params.items()} == {k: w for k, (_, _, w) in SPEED_UP.items()}
    finally:  # MindSpore's defaults back for later tests
        for k, p in params.items():
            ctx.set_param(p, before[k])
        ctx.ascend_config = ascend_config


def _msrun_command(tmp_path, *args, **env):
    """The msrun arguments scripts/msrun_train.sh would run (a stand-in msrun first on PATH prints them)."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "msrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (venv / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for f in ("msrun", "python"):
        (venv / f).chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if k != "BIND_CORE"}
    full_env.update(VIRTUAL_ENV=str(venv.parent), MASTER_PORT="8118", **env)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts/msrun_train.sh"), "2", "mindvl", *args],
                       env=full_env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout.splitlines(), r.stderr


def test_bind_core_reaches_msrun(tmp_path):
    """context.bind_core (or BIND_CORE) becomes --bind_core=True on the msrun command line of
    scripts/msrun_train.sh; off by default; the arguments of a command other than `mindvl train` are not read
    as a run config; a run config that does not load stops the launch (exit 2) before msrun starts."""
    stage = os.path.join(ROOT, "configs/stage/tiny-cpu.yaml")
    cmd = ["train", "--config", stage, "--set", "context.bind_core=true", "--out", "o"]
    rc, argv, err = _msrun_command(tmp_path, *cmd)
    assert rc == 0, err
    assert "--bind_core=True" in argv and argv[-len(cmd):] == cmd  # the command line passed through unchanged
    rc, argv, err = _msrun_command(tmp_path, "train", "--config", stage)
    assert rc == 0, err
    assert not any(a.startswith("--bind_core") for a in argv) and "--worker_num=2" in argv
    rc, argv, _ = _msrun_command(tmp_path, "train", "--config", stage, BIND_CORE="True")  # the environment wins
    assert "--bind_core=True" in argv
    rc, argv, err = _msrun_command(tmp_path, "eval", "--config", "not-a-run-config.yaml")  # only train's config
    assert rc == 0 and not any(a.startswith("--bind_core") for a in argv), err
    rc, argv, err = _msrun_command(tmp_path, "train", "--config", stage, "--set", "context.bind_cores=true")
    assert rc == 2 and argv == [] and "config error" in err and "bind_core" in err


def test_hidden_act_matches_transformers():
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    from mindvl_ms.models.text import TextForCausalLM
    from mindvl_ms.config.model import TextConfig

    outs = {}
    x = np.random.RandomState(0).randn(2, 5, 32).astype(np.float32)
    for act in ("silu", "gelu", "gelu_pytorch_tanh"):
        tc = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, mrope_section=[2, 3, 3], hidden_act=act)
        tc.validate()
        mlp = TextForCausalLM(tc).model.layers[0].mlp
        ref = Qwen3MLP(Qwen3Config(hidden_size=32, intermediate_size=48, hidden_act=act))
        with torch.no_grad():
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(ref, n).weight.copy_(torch.tensor(getattr(mlp, n).weight.asnumpy()))
            want = ref(torch.tensor(x)).numpy()
        outs[act] = mlp(Tensor(x)).asnumpy()
        np.testing.assert_allclose(outs[act], want, atol=1e-5, rtol=1e-5)
    assert np.abs(outs["silu"] - outs["gelu"]).max() > 1e-3
    bad = load_model_config(os.path.join(ROOT, "configs/model/tiny-moe.yaml")).text
    bad.hidden_act = "gelu"
    with pytest.raises(ConfigError, match="deepseek_v3 experts are SwiGLU"):
        bad.validate()


def test_rank_coords_reach_the_loader_and_grad_reduce_flag(monkeypatch):
    cfg = run_cfg("mindvl-8b.yaml", context={"device_target": "Ascend"}, parallel={"parallel_mode": 1},
                  parallel_config={"data_parallel": 16, "model_parallel": 4})
    info = D.fill_coords(D.DistInfo(rank=23, world=64), cfg)
    assert (info.dp, info.dp_rank, info.tp_rank, info.pp_rank) == (16, 5, 3, 0)
    assert info.semi_auto and info.compiler_reduces and not info.explicit_grad_reduce
    kw = D.auto_parallel_settings(cfg, 64)
    assert kw["parallel_mode"] == "semi_auto_parallel" and kw["gradients_mean"] is False
    cfg.parallel.gradients_mean = True
    assert D.auto_parallel_settings(cfg, 64)["gradients_mean"] is True
    cfg.parallel.gradients_mean = False
    cpu = run_cfg(parallel_config={"data_parallel": 2})
    info = D.fill_coords(D.DistInfo(rank=1, world=2), cpu)
    assert (info.dp_rank, info.explicit_grad_reduce, info.compiler_reduces) == (1, True, False)
    assert D.fill_coords(D.DistInfo(), run_cfg()).explicit_grad_reduce is False

    # the data loader of rank 23 reads data-parallel shard 5 of 16 (not 23)
    from mindvl_ms.data import dataset
    from mindvl_ms.train import build

    seen = {}

    class FakeLoader:
        source = None

    def from_config(c, model_config=None, collate=None):
        seen.update(dp_rank=c.dp_rank, dp_size=c.dp_size, fixed_shapes=collate is not None)
        return FakeLoader()

    monkeypatch.setattr(dataset.DataLoader, "from_config", staticmethod(from_config))
    info = D.fill_coords(D.DistInfo(rank=23, world=64), cfg)
    build.default_data_factory(cfg, cfg.stages[0], 0, info)
    assert seen == {"dp_rank": 5, "dp_size": 16, "fixed_shapes": True}  # semi-auto: the stage's RowBudget


def test_trainer_applies_parallelize_only_under_semi_auto():
    from mindvl_ms.train.build import prepare_model

    cfg = run_cfg(parallel_config={"data_parallel": 2, "model_parallel": 2})
    for semi, want in ((True, ((2, 1), (2, 1))), (False, None)):
        m = abstract()
        prepare_model(m, cfg, D.DistInfo(world=4, semi_auto=semi))
        assert strategy_of(m.model.layers[0].self_attn.q_proj.matmul) == want
