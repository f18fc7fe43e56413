"""Refusals of `parallel/validate.py`, one case per refusal, each asserting its one-line message: full_batch
without a global loader, semi-auto without a dataset_strategy covering every model input (or with one that
does not split the rows data_parallel ways), a stage with fewer micro-batches per rank than pipeline stages,
and the audit finding a primitive without a strategy in the language model or the loss head.

The shipped 671B layout (dp 8, tp 8, pp 8; stages of 1024 and 512 rows, 128 and 64 micro-batches per rank) is the base.
"""
import glob

import pytest
from mindspore import ops

from mindvl_ms.cli import main
from mindvl_ms.config import load_model_config
from mindvl_ms.config.base import ConfigError
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data.collate import INPUT_NAMES, VISION_NAMES
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.parallel import Layout, parallelize
from mindvl_ms.parallel.parallelize import shard_loss_head
from mindvl_ms.parallel.runtime import auto_parallel_settings
from mindvl_ms.parallel.validate import refuse_unsharded, unsharded, validate_parallel
from mindvl_ms.train.loss_head import ChunkedHeadCE

RUN = "configs/run/mindvl-671b-512npu.yaml"
WORLD = 512


def _cfg(*overrides):
    return load_run_config(RUN, ["parallel.full_batch=false", *overrides])


def _rows(dp, n=len(INPUT_NAMES), vision_ranks=8):
    """A dataset_strategy with the rows (dim 0) of every input split dp ways, the ViT's inputs (each rank's
    share of its TP group's images, vision_parallel dp) dp x vision_ranks ways."""
    return tuple((dp * vision_ranks if name in VISION_NAMES else dp, 1, 1) for name in INPUT_NAMES[:n])


def _refusal(cfg, settings):
    with pytest.raises(ConfigError) as e:
        validate_parallel(cfg, WORLD, settings, RUN)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(RUN + ": ")
    return msg


def test_the_shipped_layout_with_its_row_split_passes():
    validate_parallel(_cfg(), WORLD, {"dataset_strategy": _rows(8)}, RUN)
    validate_parallel(_cfg("parallel_config.pipeline_stage=1", "parallel_config.offset=[]"), WORLD,
                      {"dataset_strategy": _rows(8)}, RUN)


def test_full_batch_without_a_global_loader():
    msg = _refusal(_cfg("parallel.full_batch=true"), {"dataset_strategy": _rows(8)})
    assert msg == (f"{RUN}: parallel.full_batch is true, but each rank loads only its 1/8 data-parallel shard of "
                   f"the global batch (there is no global loader); expected full_batch: false")


def test_semi_auto_without_a_dataset_strategy():
    msg = _refusal(_cfg(), {})
    assert "parallel.parallel_mode 1 (semi/auto parallel) without a dataset_strategy" in msg
    assert "expected one entry per model input ['input_ids', 'position_ids'" in msg and "8) ways" in msg


def test_a_dataset_strategy_missing_inputs():
    msg = _refusal(_cfg(), {"dataset_strategy": _rows(8, n=3)})
    assert f"dataset_strategy has 3 entries; expected one per model input ({len(INPUT_NAMES)}:" in msg


def test_a_dataset_strategy_that_splits_all_devices_or_not_the_rows():
    bad = list(_rows(8))
    bad[INPUT_NAMES.index("pixel_values")] = (512, 1, 1)   # dim 0 over every device, MindSpore's default
    bad[INPUT_NAMES.index("position_ids")] = (1, 8, 1)    # M-RoPE's 3 first: the rows are not dim 0
    msg = _refusal(_cfg(), {"dataset_strategy": tuple(bad)})
    assert ("does not split the rows of position_ids (1, 8, 1) (expected (8, 1, ...)), pixel_values (512, 1, 1) "
            "(expected (64, 1, ...)): the rows go data_parallel (8) ways, the ViT inputs data_parallel x "
            "vision_ranks (64) ways") in msg


def test_vision_inputs_split_by_rows_only_under_vision_parallel_dp():
    """With vision_parallel dp each rank of a TP group feeds its own share of the images: a strategy that
    gives the TP peers the same ViT inputs (split dp ways, as before the balanced split) is refused; with
    vision_parallel tp (the ViT sharded like the LLM, peers reading the same rows) it is the right one."""
    msg = _refusal(_cfg(), {"dataset_strategy": _rows(8, vision_ranks=1)})
    assert "pixel_values (8, 1, 1) (expected (64, 1, ...))" in msg and "window_gather (8, 1, 1)" in msg
    assert "input_ids" not in msg
    validate_parallel(_cfg("parallel_config.vision_parallel=tp"), WORLD,
                      {"dataset_strategy": _rows(8, vision_ranks=1)}, RUN)


def test_fewer_micro_batches_per_rank_than_pipeline_stages():
    msg = _refusal(_cfg("stages.2.global_batch_size=32"), {"dataset_strategy": _rows(8)})
    assert msg == (f"{RUN}: stage 'sft' gives each rank 4 micro-batches (global_batch_size 32 / (data_parallel 8 x "
                   f"micro_batch_size 1)), fewer than pipeline_stage 8: the pipeline would idle; expected at least 8")


def test_global_batch_not_a_whole_number_of_micro_batches():
    msg = _refusal(_cfg("stages.2.global_batch_size=500"), {"dataset_strategy": _rows(8)})
    assert msg == (f"{RUN}: stage 'sft' global_batch_size 500 is not data_parallel (8) x micro_batch_size (1) x a "
                   f"whole number of micro-batches")


def test_data_parallel_mode_has_nothing_to_check():
    validate_parallel(_cfg("parallel.parallel_mode=0", "parallel.full_batch=true", "parallel_config.pipeline_stage=1",
                           "parallel_config.offset=[]"), WORLD, {}, RUN)


def test_audit_refuses_a_primitive_without_a_strategy():
    """The tiny dense model after parallelize: 0 unsharded in the LLM and the head; one strategy taken away
    (as a new primitive without one) is refused by type and cell, in the LLM and in the loss head."""
    model = MindVLModel(load_model_config("configs/model/tiny.yaml"))
    parallelize(model, Layout(dp=2, tp=2, vocab_emb_dp=False))
    head = ChunkedHeadCE()
    assert unsharded(head)["MatMul"] == "mm_nt"                          # before shard_loss_head: none sharded
    assert shard_loss_head(head, model) and unsharded(head) == {}
    refuse_unsharded(model, head)                                        # nothing left without a strategy
    layer = model.model.layers[1]
    layer.self_attn.o_proj.matmul = ops.MatMul(transpose_b=True)
    with pytest.raises(ConfigError) as e:
        refuse_unsharded(model, head)
    assert str(e.value) == ("parallel audit: primitives without a shard strategy in the language model or loss "
                            "head: MatMul (e.g. model.layers.1.self_attn.o_proj.matmul); expected every one "
                            "sharded by parallelize (parallel/parallelize.py)")
    head.exp = ops.Exp()
    with pytest.raises(ConfigError, match=r"Exp \(e\.g\. loss head exp\)"):
        refuse_unsharded(head=head)


@pytest.mark.parametrize("path", sorted(glob.glob("configs/run/*.yaml")))
def test_shipped_runs_pass_with_the_runtime_dataset_strategy(path):
    """What `setup` and `mindvl plan` check: the shipped Ascend runs with the dataset_strategy the runtime
    gives set_auto_parallel_context (parallel.runtime.dataset_strategy)."""
    cfg = load_run_config(path)
    world = Layout.from_run_config(cfg).world
    settings = auto_parallel_settings(cfg, world)
    assert cfg.parallel.parallel_mode == 1 and settings["full_batch"] is False
    validate_parallel(cfg, world, settings, path)


def test_mindvl_plan_refuses(capsys):
    assert main(["plan", "--config", "configs/run/mindvl-8b-64npu.yaml", "--set", "parallel.full_batch=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("config error: configs/run/mindvl-8b-64npu.yaml: parallel.full_batch is true, but each rank loads "
                   "only its 1/16 data-parallel shard of the global batch (there is no global loader); expected "
                   "full_batch: false")
