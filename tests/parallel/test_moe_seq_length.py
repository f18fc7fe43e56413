"""The MoE dispatcher (MindFormers' MoEAlltoAllTokenDispatcher inside `parallel.moe.EPExperts`) is built for the
stage's seq_length, not MindFormers' default 4096: from the `seq_length` keyword, from a RunConfig's first stage,
and set again for a later stage by `set_moe_seq_length`, read back from the built cells."""
from mindvl_ms.config import load_model_config
from mindvl_ms.config.train import load_run_config
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import Layout, parallelize
from mindvl_ms.parallel.mindformers_moe import transformer_config
from mindvl_ms.parallel.moe import EPExperts, set_moe_seq_length

MODEL = "configs/model/tiny-moe.yaml"


def _dispatchers(model):
    return {name: cell for name, cell in model.cells_and_names() if isinstance(cell, EPExperts)}


def test_dispatcher_built_for_the_given_seq_length_and_reset_per_stage():
    model = MindVLModel(load_model_config(MODEL))
    parallelize(model, Layout(dp=2, tp=2, ep=2), seq_length=8192)
    eps = _dispatchers(model)
    assert eps and all(c.seq_length == 8192 and c.dispatcher.seq_length == 8192 for c in eps.values())
    assert transformer_config(4, 2, 8).seq_length == 4096           # MindFormers' default, no longer what it gets
    assert sorted(set_moe_seq_length(model, 2048)) == sorted(eps)   # a later stage's rows
    assert all(c.dispatcher.seq_length == 2048 for c in _dispatchers(model).values())
    assert set_moe_seq_length(model, 2048) == []


def test_run_config_first_stage_sizes_the_dispatcher():
    """The shipped 671B run (stages at 8192) with its layout scaled to the tiny MoE: the dispatchers get 8192."""
    run = load_run_config("configs/run/mindvl-671b-512npu.yaml")
    assert [st.seq_length for st in run.stages] == [8192, 8192, 8192]
    pc = run.parallel_config
    pc.data_parallel, pc.model_parallel, pc.pipeline_stage, pc.expert_parallel, pc.offset = 2, 2, 1, 2, []
    model = MindVLModel(load_model_config(MODEL))
    parallelize(model, run)
    assert {c.dispatcher.seq_length for c in _dispatchers(model).values()} == {8192}
