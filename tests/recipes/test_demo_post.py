"""configs/demo/post.yaml and the post-training demo's pieces: the file read with its data from disk (its
training run is `mindvl demo --post-train` in tests/recipes/test_demo_quick.py), the demo's paths and
overrides, and the evaluation backends the post-training evaluation streams its checkpoints into."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.config.train import load_run_config
from mindvl_ms.infer.rollout import EngineSampler
from mindvl_ms.train import run_training

from tests.support.paths import ROOT  # noqa: E402
BOX = "<|box_start|>(100,200),(500,600)<|box_end|>"


def _files(tmp):
    (tmp / "img").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(tmp / "img" / "a.png")
    user = {"role": "user", "content": "<image>\nWhere is the circle?"}
    sft = [{"images": ["img/a.png"], "messages": [user, {"role": "assistant", "content": BOX}]}] * 2
    (tmp / "ground.jsonl").write_text("".join(json.dumps(x) + "\n" for x in sft))
    pairs = [{"images": ["img/a.png"], "messages": [user], "chosen": BOX, "rejected": "left"}] * 2
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))


def test_post_yaml_reads_its_files_and_refuses_a_pair_longer_than_a_row(tmp_path):
    """configs/demo/post.yaml on a narrowed model, its data read from disk by the default data path (real
    tokenizer and image processor): a preference pair longer than the DPO stage's seq_length is refused by
    name before anything compiles. The file's training run (DPO with the NTP mix, then GRPO with the IoU
    reward) is tests/recipes/test_demo_quick.py's `mindvl demo --post-train`, which runs it through
    configs/demo/post_train.yaml; each step alone: tests/train/post/test_dpo_train.py, test_grpo_train.py,
    test_ntp_mix.py."""
    _files(tmp_path)
    small = ["model.vision.depth=1", "model.vision.fullatt_block_indexes=[0]", "model.vision.hidden_size=32",
             "model.vision.intermediate_size=32", "model.vision.num_heads=2", "model.vision.out_hidden_size=32",
             "model.text.hidden_size=32", "model.text.intermediate_size=32", "model.text.num_hidden_layers=1",
             "model.text.num_attention_heads=2", "model.text.num_key_value_heads=1", "model.text.head_dim=16",
             "model.text.mrope_section=[4,2,2]", "init_from=''", "data.tokenizer=''", "plot=false",
             "data.max_image_tokens=0"]  # a random model: the Qwen3 tokenizer; rows of 128 tokens, no separate visual budget
    stage = ["seq_length=128", "global_batch_size=2", "micro_batch_size=2", "max_steps=1"]
    sets = small + [f"stages.{i}.{s}" for i in (0, 1) for s in stage] + [
        f"stages.0.data.sources=[{{path: {tmp_path / 'pairs.jsonl'}}}]",
        f"stages.0.dpo.ntp_sources=[{tmp_path / 'ground.jsonl'}]",
        f"stages.1.data.sources=[{{path: {tmp_path / 'ground.jsonl'}}}]",
        "stages.1.grpo.group_size=2", "stages.1.grpo.mini_batch_size=2",  # the file validates with the narrowed batch
        "stages.0.seq_length=80"]
    cfg = load_run_config(os.path.join(ROOT, "configs", "demo", "post.yaml"), sets)
    assert [(s.name, s.type, s.seq_length) for s in cfg.stages] == [("dpo", "dpo", 80), ("grpo", "grpo", 128)]
    with pytest.raises(ValueError, match=r"pair 0 needs \d+ tokens .* seq_length is 80"):
        run_training(cfg, str(tmp_path / "short"), progress=False, sampler=EngineSampler())


def test_post_train_demo_config_paths_and_overrides(tmp_path):
    """configs/demo/post_train.yaml: runs/demo/ paths move to --out, `demo.` overrides set the demo section
    (unknown keys are refused), and a missing demo run is named with the command that makes it."""
    from mindvl_ms.config.base import ConfigError
    from mindvl_ms.recipes.demo.post import load_post_config, run_post_train

    path = os.path.join(ROOT, "configs", "demo", "post_train.yaml")
    out = str(tmp_path / "d")
    cfg, demo = load_post_config(path, out, ["demo.rollout.k=8", "stages.1.max_steps=3"])
    assert cfg.init_from == os.path.join(out, "merged")
    assert cfg.stages[0].data["sources"][0]["path"] == os.path.join(out, "post", "data", "pairs.jsonl")
    assert cfg.stages[1].data["sources"][0]["path"] == os.path.join(out, "post", "data", "prompts.jsonl")
    assert cfg.stages[0].dpo.ntp_sources == [os.path.join(out, "data", "train_vqa.jsonl"),
                                             os.path.join(out, "data", "train_ocr.jsonl")]
    assert demo["rollout"]["k"] == 8 and cfg.stages[1].max_steps == 3
    base, _ = load_post_config(path, out)
    assert base.stages[1].max_steps != 3
    with pytest.raises(ConfigError, match="no 'rollout.kk'"):
        load_post_config(path, out, ["demo.rollout.kk=8"])
    with pytest.raises(ConfigError, match=r"run `mindvl demo --out .*` first"):
        run_post_train(out, progress=False)


def test_eval_phase_takes_over_the_kept_model_and_gives_its_checkpoint_back(tmp_path):
    """With the phases in one process, the post-training evaluation streams the next checkpoints into the
    model `evaluation.eval_backend` keeps for one of them (its graphs are compiled already) and, on exit
    (`post_phases.kept_checkpoint_restored`), loads that checkpoint back, so it is kept again with its own
    weights; without a kept checkpoint there is nothing to restore."""
    import mindspore as ms
    from mindspore import Tensor

    from mindvl_ms.checkpoint.pretrained import save_pretrained
    from mindvl_ms.models.mindvl import MindVLModel
    from mindvl_ms.recipes.demo import evaluation
    from mindvl_ms.recipes.demo.post_phases import kept_checkpoint_restored
    from tests.support import post as H

    cfg = load_run_config(data={"seed": 0, "model": H.MODEL, "stages": [{"name": "x", "max_steps": 1}]})
    ms.set_seed(0)
    model = MindVLModel(cfg.model)
    save_pretrained(model, str(tmp_path / "merged"))
    own = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    rng = np.random.default_rng(1)
    for p in model.get_parameters():
        p.set_data(Tensor((own[p.name] + rng.standard_normal(p.shape)).astype(own[p.name].dtype)))
    save_pretrained(model, str(tmp_path / "dpo"))
    dpo = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    ckpts = {"merged": str(tmp_path / "merged"), "dpo": str(tmp_path / "dpo")}
    with kept_checkpoint_restored(ckpts, cfg.data, 4):
        pass
    assert evaluation.cached_backend(ckpts["merged"]) is None  # nothing kept, nothing restored
    cached = evaluation.eval_backend(ckpts["merged"], cfg.data, 4)
    try:
        with kept_checkpoint_restored(ckpts, cfg.data, 4):
            got = evaluation.eval_backend(ckpts["dpo"], cfg.data, 4)
            assert got.model is cached.model and got.engine is cached.engine
            for p in got.model.get_parameters():
                np.testing.assert_array_equal(p.asnumpy(), dpo[p.name], err_msg=p.name)
            got.engine.image_cache["x"] = np.zeros(1)
        back = evaluation.cached_backend(ckpts["merged"])
        assert back.model is cached.model and not cached.engine.image_cache
        assert evaluation.cached_backend(ckpts["dpo"]) is None
        for p in cached.model.get_parameters():
            np.testing.assert_array_equal(p.asnumpy(), own[p.name], err_msg=p.name)
    finally:
        evaluation._BACKENDS.pop(os.path.abspath(ckpts["dpo"]), None)
        evaluation._BACKENDS.pop(os.path.abspath(ckpts["merged"]), None)
