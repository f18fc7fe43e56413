"""CPU emulation of semi-auto parallel's data semantics: with `full_batch` false each rank loads its own
rows and the graph sees the global batch as the ranks' local arrays concatenated along the
`dataset_strategy` dimensions (parallel/runtime.dataset_strategy: rows split data_parallel ways, TP
peers reading the same rows; rank = dp_rank * tp + tp_rank, the coordinates of runtime.fill_coords).

- Shard consistency: for dp=2 and dp2 x tp2, each rank builds its inputs from a real mixed image + video
  set as the loader does (processed samples, packed rows, its slice of the global batch, collated under the
  stage's fixed `RowBudget`); the concatenation, run stand-alone on CPU through the model and the train
  step's loss (`ForwardLoss`, sparse head, balanced loss), gives the logits and loss of the global batch
  built at once, for the tiny dense model and the tiny MoE.
- Equal local shapes: every rank's local input shapes are equal at every step of a stage, over a real
  mixed data set read by the per-rank loaders.
- The shipped Ascend layouts set full_batch false and that dataset_strategy.
- Static shapes: constant dims are never dynamic; a stage's RowBudget fixes every dim.
"""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn
from mindspore.nn.utils import no_init_parameters

from tests.support.video import write_mixed_media
from mindvl_ms.config import load_model_config
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.config.video import VideoConfig
from mindvl_ms.data.collate import INPUT_NAMES, VISION_NAMES, build_model_inputs, row_budget, share_budget
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.data.offline import pack_file
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import parse_line
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.config.train import load_run_config
from mindvl_ms.parallel.runtime import SUPERVISED_GRIDS, auto_parallel_settings, dataset_strategy
from mindvl_ms.parallel.vit_balance import GroupMerge
from mindvl_ms.train.build import static_collate
from mindvl_ms.train.batches import rank_slice
from mindvl_ms.train.forward_loss import ForwardLoss
from mindvl_ms.train.loss import TrainLoss
from mindvl_ms.train.loss_head import supervised_layout
from mindvl_ms.train.train_step import constant_dims, dynamic_like

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, VISUAL, CHUNK = 160, 128, 64
TOL = 1e-6
LOSS_NAMES = ("sup_targets", "sup_segment_ids", "sup_token_index", "logit_index")


def _data_config(**kw):
    return DataConfig(seq_length=SEQ, max_image_tokens=VISUAL,
                      image=ImageConfig(min_pixels=8 * 784, max_pixels=64 * 784),
                      video=VideoConfig(video_min_pixels=8 * 784, video_max_pixels=16 * 784,
                                        video_total_pixels=64 * 784), **kw)


def _lines():
    say = lambda q, a: [{"role": "user", "content": q}, {"role": "assistant", "content": a}]  # noqa: E731
    return [
        {"images": ["img/astro.png"], "messages": say("<image>Who is this?", "an astronaut in a white suit")},
        {"videos": ["a.mkv"], "messages": say("<video>\nWhich way does the square move?", "to the right")},
        {"images": ["img/coffee.jpg"], "videos": ["b.mkv"],
         "messages": say([{"type": "image"}, {"type": "text", "text": " then "}, {"type": "video"},
                          {"type": "text", "text": " same colour?"}], "no, the video changes colour")},
        {"messages": say("Name three colours.", "red, green and blue")},
        {"images": ["img/cat.png", "img/rocket.jpg"], "messages": say("<image><image>Compare.", "a cat, a rocket")},
        {"videos": ["b.mkv"], "messages": say("<video>What moves?", "a white square")},
        {"images": ["img/page.png"], "messages": say("<image>Read it.", "some printed text")},
        {"messages": say("Count to five.", "one two three four five") + say("And back?", "five four three two one")},
    ]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    write_mixed_media(d)
    lines = [dict(o, id=f"s{i}") for i, o in enumerate(_lines())]
    path = d / "mixed.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return str(path)


@pytest.fixture(scope="module")
def rows(data_file):
    """The global batch: 4 packed rows of processed image, video, image + video and text samples."""
    proc = MindVLProcessor(config=_data_config())
    text = open(data_file).read().splitlines()
    s = [proc.process_sample(parse_line(t, data_file, i + 1)) for i, t in enumerate(text)]
    assert any("pixel_values_videos" in x for x in s) and any("pixel_values" in x for x in s)
    return [[s[0], s[3]], [s[1], s[6]], [s[2], s[7]], [s[4], s[5]]]


def _model(name):
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", name))
    ms.set_seed(0)
    return MindVLModel(cfg)


def _arrays(rows, model, budget):
    """One rank's graph inputs as its loader and train step build them: model inputs + the head's grids."""
    batch = build_model_inputs(rows, model.config, budget=budget)
    return _step_arrays(batch), batch


def _step_arrays(batch):
    lay = supervised_layout(batch["targets"], batch["segment_ids"], batch["token_index"], CHUNK, SEQ)
    return [batch[k] for k in INPUT_NAMES] + [lay[k] for k in LOSS_NAMES]


def _assemble(local, dp, tp, vision_ranks=1):
    """The global arrays the graph sees: ranks' local arrays concatenated along the dimension each
    dataset_strategy entry splits (rank = dp_rank * tp + tp_rank); ranks that an entry does not split
    (TP peers under a dp split) must hold the same arrays."""
    strategy = dataset_strategy(dp, vision_ranks)
    assert len(strategy) == len(INPUT_NAMES) + SUPERVISED_GRIDS
    out = []
    for i, st in enumerate(strategy[:len(local[0])]):
        n = st[0]
        assert st == (n,) + (1,) * (local[0][i].ndim - 1) and n in (dp, dp * tp)
        per = dp * tp // n  # consecutive ranks that hold one slice
        for r in range(dp * tp):
            np.testing.assert_array_equal(local[r][i], local[r - r % per][i])
        out.append(np.concatenate([local[k * per][i] for k in range(n)], axis=0))
    return out


class _LogitsAndLoss(nn.Cell):
    """(*model inputs, *loss inputs, token_norm, num_samples, scale) -> (the model's logits, the train step's
    loss): the model and its `ForwardLoss` (sparse head, balanced loss) in one graph, one compile per shape."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model = model
        self.step = ForwardLoss(model, TrainLoss("balanced"), len(INPUT_NAMES), INPUT_NAMES.index("segment_ids"),
                                sparse=True)

    def construct(self, *args):
        return self.model(*args[:len(INPUT_NAMES)])[0], self.step(*args)[0]


def _run(net, arrays, num_samples):
    scalars = [Tensor(-1.0, ms.float32), Tensor(float(num_samples), ms.float32), Tensor(1.0, ms.float32)]
    logits, loss = net(*[Tensor(a) for a in arrays], *scalars)
    return logits.asnumpy(), float(loss.asnumpy())


@pytest.fixture(scope="module")
def ref(request, rows):
    """One model config's global batch built at once, its logits and loss: the reference of both the
    plain ranks' and the balanced shares' test."""
    model = _model(request.param)
    budget = row_budget(model.config, _data_config())
    glob, batch = _arrays(rows, model, budget)
    net = _LogitsAndLoss(model)
    num_samples = int(batch["num_samples"])
    logits, loss = _run(net, glob, num_samples)
    return SimpleNamespace(model=model, net=net, budget=budget, glob=glob, batch=batch, num_samples=num_samples,
                           logits=logits, loss=loss)


@pytest.mark.slow
@pytest.mark.parametrize("ref", ["tiny.yaml", "tiny-moe.yaml"], indirect=True)
def test_ranks_concatenated_equal_the_global_batch(rows, ref):
    model, budget, glob, num_samples = ref.model, ref.budget, ref.glob, ref.num_samples
    ref_logits, ref_loss = ref.logits, ref.loss
    assert np.isfinite(ref_loss) and ref_loss > 0
    for dp, tp in ((2, 1), (2, 2)):
        local = [_arrays(rank_slice(rows, r // tp, dp), model, budget)[0] for r in range(dp * tp)]
        assert {tuple(a.shape for a in arrs) for arrs in local} == {tuple(a.shape[:0] + (a.shape[0] // dp,)
                                                                          + a.shape[1:] for a in glob)}
        logits, loss = _run(ref.net, _assemble(local, dp, tp), num_samples)  # the global batch's shapes
        diff = float(np.abs(logits - ref_logits).max())
        assert diff <= TOL, f"dp{dp} x tp{tp}: logits differ from the global batch by {diff}"
        assert abs(loss - ref_loss) <= TOL, f"dp{dp} x tp{tp}: loss {loss} vs global {ref_loss}"


@pytest.mark.slow
@pytest.mark.parametrize("ref", ["tiny.yaml", "tiny-moe.yaml"], indirect=True)
def test_balanced_vision_shares_equal_the_global_batch(rows, ref):
    """vision_parallel dp, dp 2 x tp 2: each TP group's 2 ranks take their own share of the group's images
    (`vit_balance.balanced_batch` through the trainer's collate under semi-auto), the ViT inputs split over all 4
    ranks and the rest over dp; the concatenation through the graph with the group merge that
    `parallelize` puts in (`GroupMerge`: the TP all-gather is where its two Identities' layouts differ, an
    identity stand-alone; the shard strategies are checked in test_audit.py) gives the global batch's logits and loss. Every rank's arrays have one shape,
    and each rank encodes a part of its group's images, every image once."""
    model = ref.model
    data = _data_config(micro_batch_size=2)
    budget, share = row_budget(model.config, data), share_budget(model.config, data, 2)
    glob, batch = _arrays(rows, model, budget)
    for a, b in zip(glob, ref.glob, strict=True):  # this budget's global batch is the reference's
        np.testing.assert_array_equal(a, b)
    num_samples = int(batch["num_samples"])
    ref_logits, ref_loss = ref.logits, ref.loss
    dp, tp = 2, 2
    local, encoded = [], []
    for r in range(dp * tp):
        d, t = divmod(r, tp)
        mine = static_collate(model.config, data, tp, t)(rank_slice(rows, d, dp))  # the trainer's collate
        local.append(_step_arrays(mine))
        encoded.append(int((mine["pixel_values"] != 0).any(-1).sum()))
    assert len({tuple(a.shape for a in arrs) for arrs in local}) == 1
    assert local[0][INPUT_NAMES.index("pixel_values")].shape == (1, share.patches, 1176)
    assert min(encoded) > 0 and sum(encoded) == int(np.prod(batch["image_grid_thw"], 1).sum())
    row_merge = model.merge
    model.merge = GroupMerge(dp, tp)  # as parallelize(..., vision_parallel="dp") does (tests/parallel/test_audit.py)
    try:  # a new graph Cell: compiled with the group merge (the reference's graph keeps the row merge)
        logits, loss = _run(_LogitsAndLoss(model), _assemble(local, dp, tp, vision_ranks=tp), num_samples)
    finally:
        model.merge = row_merge  # the module's model is shared with the other tests of its config
    diff = float(np.abs(logits - ref_logits).max())
    assert diff <= TOL, f"balanced dp2 x tp2: logits differ from the global batch by {diff}"
    assert abs(loss - ref_loss) <= TOL, f"balanced dp2 x tp2: loss {loss} vs global {ref_loss}"


def test_every_rank_has_equal_local_shapes_at_every_step(data_file, tmp_path):
    """Per-rank loaders over a real mixed set (offline packing, balanced ranks; the stage's fixed budget): at every step
    every rank's arrays have one shape, the budget's, micro_batch_size rows included (an epoch's short last
    micro-batch is filled with empty rows)."""
    lines = open(data_file).read().splitlines()
    big = tmp_path / "many.jsonl"
    img = os.path.join(os.path.dirname(data_file), "img")
    os.symlink(img, tmp_path / "img")
    for v in ("a.mkv", "b.mkv"):
        os.symlink(os.path.join(os.path.dirname(data_file), v), tmp_path / v)
    big.write_text("".join(json.dumps(dict(json.loads(t), id=f"r{k}-{i}")) + "\n"
                           for k in range(3) for i, t in enumerate(lines)))
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    dp = 2
    pack_file(str(big), str(tmp_path / "packed"), _data_config(dp_size=dp), workers=1, progress=False)
    data = [_data_config(packed_dir=str(tmp_path / "packed"), micro_batch_size=2, dp_size=dp, dp_rank=r)
            for r in range(dp)]
    budget = row_budget(cfg, data[0])
    loaders = [DataLoader.from_config(d, model_config=cfg,
                                      collate=lambda rows: build_model_inputs(rows, cfg, budget=budget))
               for d in data]
    steps = [list(loader) for loader in loaders]
    assert len(steps[0]) == len(steps[1]) >= 2
    patches = 0
    for per_rank in zip(*steps):
        shapes = [{k: b[k].shape for k in INPUT_NAMES} for b in per_rank]
        assert shapes[0] == shapes[1], shapes
        assert shapes[0]["input_ids"] == (2, budget.seq_length)  # micro_batch_size rows at every step
        assert shapes[0]["pixel_values"][1:] == (budget.patches, 1176)
        assert shapes[0]["window_gather"][1:] == (budget.window_blocks, budget.window_width)
        assert shapes[0]["full_gather"][1:] == (budget.full_blocks, budget.full_width)
        assert shapes[0]["actual_seq_len"][1:] == (budget.slots,)
        patches += sum(int(np.prod(b["image_grid_thw"], 1).sum()) for b in per_rank)
    assert patches > 0  # images and videos were read


@pytest.mark.parametrize("run", ["mindvl-8b-64npu.yaml", "mindvl-671b-512npu.yaml", "openpangu-vl-7b-64npu.yaml"])
def test_shipped_ascend_runs_split_rows_by_dataset_strategy(run):
    """Every shipped Ascend layout: each rank loads its own rows (full_batch false) and the graph is told
    which (dataset_strategy: rows split data_parallel ways, one entry per train-step input)."""
    cfg = load_run_config(os.path.join(ROOT, "configs", "run", run))
    sizes = cfg.parallel_config
    world = sizes.data_parallel * sizes.model_parallel * sizes.pipeline_stage
    kw = auto_parallel_settings(cfg, world)
    assert kw["parallel_mode"] == "semi_auto_parallel" and kw["full_batch"] is False
    assert cfg.parallel.full_batch is False
    strategy = kw["dataset_strategy"]
    assert len(strategy) == len(INPUT_NAMES) + SUPERVISED_GRIDS  # the one-graph step's inputs
    vision = sizes.data_parallel * (sizes.model_parallel if sizes.vision_parallel == "dp" else 1)
    for name, st in zip(INPUT_NAMES + LOSS_NAMES, strategy):  # the ViT's inputs: each rank its own share
        assert st[0] == (vision if name in VISION_NAMES else sizes.data_parallel) and set(st[1:]) <= {1}


def test_static_shapes_keep_constant_dims_and_fix_every_dim_per_stage(rows):
    """Constant dims (M-RoPE's 3, the patch width, the (row, col) pair) are never declared dynamic, neither
    by the model's placeholders nor by the train step's; under a stage's RowBudget every dim is fixed and
    equals what the collate builds."""
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    with no_init_parameters():
        model = MindVLModel(cfg)
    dyn = {k: tuple(t.shape) for k, t in zip(INPUT_NAMES, model.dynamic_inputs())}
    assert dyn["position_ids"] == (-1, 3, -1) and dyn["pixel_values"] == (-1, -1, 1176)
    assert dyn["vision_pos_ids"] == (-1, -1, 2)
    budget = row_budget(cfg, _data_config())
    batch = build_model_inputs(rows[:2], cfg, budget=budget)
    fixed = [tuple(t.shape) for t in model.dynamic_inputs((budget, 2))]
    assert fixed == [batch[k].shape for k in INPUT_NAMES]
    step = [tuple(t.shape) for t in dynamic_like([batch[k] for k in INPUT_NAMES], constant_dims(model))]
    assert step == list(dyn.values())


def test_empty_rows_that_fill_a_short_micro_batch_change_nothing_real(rows):
    """A budget of 3 rows over a 2-row micro-batch: the real rows' arrays are those of the 2-row batch, the
    added row has no targets, no segments and no samples."""
    cfg = load_model_config(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    budget = row_budget(cfg, _data_config(micro_batch_size=3))
    two = build_model_inputs(rows[:2], cfg, budget=budget._replace(rows=0))
    three = build_model_inputs(rows[:2], cfg, budget=budget)
    assert budget.rows == 3
    for k in INPUT_NAMES + ("targets",):
        assert three[k].shape == (3,) + two[k].shape[1:], k
        np.testing.assert_array_equal(three[k][:2], two[k], err_msg=k)
    assert (three["targets"][2] == -100).all() and (three["segment_ids"][2] == 0).all()
    assert three["num_samples"] == two["num_samples"]
