"""A model vocabulary that is a subset of the tokenizer's (data/vocab_subset.py, the demo's `vocab: data`):
the subset tokenizer renumbers the full tokenizer's ids (checked against list positions), rejects text
outside it by name, and a model over the subset gives exactly the full model's logits at the subset's
ids when its embedding rows are the full model's rows at those ids (images included, so the remapped
special token ids are exercised).

    python -m pytest -q tests/data/test_vocab_subset.py
"""
import copy
import json
import os
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindvl_ms.checkpoint.pretrained import load_into, model_tensors
from mindvl_ms.checkpoint.io import RawTensor
from mindvl_ms.config.base import load, read_yaml
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import iter_jsonl
from mindvl_ms.data.tokenizer import SubsetTokenizer, load_tokenizer
from mindvl_ms.data.vocab_subset import restrict_model_config, subset_ids, write_subset
from mindvl_ms.recipes.demo.datasets import write_demo_data
from mindvl_ms.eval.benchmark import load_benchmark
from mindvl_ms.data.collate import INPUT_NAMES, build_model_inputs
from mindvl_ms.checkpoint.pretrained import save_pretrained
from mindvl_ms.models.mindvl import MindVLModel

from tests.support.paths import ROOT  # noqa: E402
DATA_CFG = {"system_prompt": "", "image": {"min_pixels": 12544, "max_pixels": 12544}}


def prompts(paths):
    """The held-out benchmarks' prompts as `mindvl eval` reads them (what `mindvl demo` passes)."""
    return [it.messages for p in paths for it in load_benchmark(p)]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("data"))
    info = write_demo_data(d, seed=0, sizes={"vqa": (6, 3), "ocr": (2, 2), "grounding": (2, 2)}, progress=False)
    read = lambda split: [s for t in ("vqa", "ocr", "grounding") for _, s in iter_jsonl(info["files"][split][t])]
    proc = MindVLProcessor(config=load(DataConfig, dict(DATA_CFG), "test"))
    heldout = list(info["files"]["heldout"].values())
    ids = subset_ids(proc, read("train"), prompts=prompts(heldout))
    sub_dir = write_subset(str(tmp_path_factory.mktemp("tok")), proc.tokenizer, ids)
    return proc, ids, sub_dir, read("train"), heldout


def test_subset_tokenizer_renumbers_the_full_tokenizer(demo_data):
    proc, ids, sub_dir, train, _ = demo_data
    full = proc.tokenizer
    tok = load_tokenizer(sub_dir)
    assert isinstance(tok, SubsetTokenizer) and tok.vocab_size == len(ids) and ids == sorted(set(ids))
    text = train[0].messages[0]["content"].replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    base = full.encode(text)
    assert tok.encode(text) == [ids.index(i) for i in base]           # position in the sorted id list
    assert tok.decode(tok.encode(text)) == full.decode(base) == text
    assert tok.encode_offsets(text)[1] == full.encode_offsets(text)[1]
    assert tok.encode_batch([text, "yes"]) == [[ids.index(i) for i in full.encode(t)] for t in (text, "yes")]
    for special in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|im_end|>"):
        assert tok.token_to_id(special) == ids.index(full.token_to_id(special))
    assert not tok.has_token("<|endoftext|>") and full.has_token("<|endoftext|>")
    with pytest.raises(ValueError, match=r"vocab_subset.json: token .* is not in this \d+-token vocabulary subset"):
        tok.encode("a zebra on a trampoline")
    # a checkpoint's processor carries the subset (tokenizer files + vocab_subset.json)
    assert isinstance(MindVLProcessor(config=load(DataConfig, dict(DATA_CFG, tokenizer=sub_dir), "t")).tokenizer,
                      SubsetTokenizer)


def test_subset_holds_train_text_and_heldout_prompts_only(demo_data, tmp_path):
    proc, ids, _, train, heldout = demo_data
    full = proc.tokenizer
    for s in train:  # every train input id (template, image pads, question, answer) is in
        assert set(proc.process_sample(s)["input_ids"].tolist()) <= set(ids)
    for msgs in prompts(heldout):  # and every held-out prompt as generation encodes it
        assert set(proc.encode(msgs, [1], add_generation_prompt=True)[0].tolist()) <= set(ids)
    line = json.loads(open(heldout[0]).readline())
    assert line["messages"][-1]["role"] == "assistant"
    line["messages"][-1]["content"] = "zebra"         # a held-out answer adds nothing
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(line) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # the demo's task/metric fields are benchmark fields
        q = prompts([str(bench)])
    assert subset_ids(proc, train, prompts=q) == subset_ids(proc, train, prompts=prompts(heldout)[:1])
    assert "zebra" not in full.decode(subset_ids(proc, train, prompts=q))
    q[0][0]["content"] = "zebra?"                     # a held-out prompt token does
    assert set(full.encode("zebra")) <= set(subset_ids(proc, train, prompts=q))
    bad = tmp_path / "bad"
    write_subset(str(bad), full, ids)
    d = json.load(open(bad / "vocab_subset.json"))
    json.dump(dict(d, base_vocab_size=1000), open(bad / "vocab_subset.json", "w"))
    with pytest.raises(ValueError, match="written for a tokenizer of 1000 tokens"):
        load_tokenizer(str(bad))


def test_subset_model_logits_equal_full_model_logits_at_subset_ids(demo_data):
    proc, ids, sub_dir, train, _ = demo_data
    cfg = load(MindVLConfig, read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml")), "tiny.yaml")
    sub_cfg = copy.deepcopy(cfg)
    sub_proc = MindVLProcessor(config=load(DataConfig, dict(DATA_CFG, tokenizer=sub_dir), "t"))
    restrict_model_config(sub_cfg, sub_proc.tokenizer)
    assert sub_cfg.text.vocab_size == len(ids) and sub_cfg.image_token_id == ids.index(cfg.image_token_id)
    rows = lambda p: [[p.process_sample(s) for s in train[:3]], [p.process_sample(s) for s in train[-2:]]]
    full_b, sub_b = build_model_inputs(rows(proc), cfg), build_model_inputs(rows(sub_proc), sub_cfg)
    real = full_b["segment_ids"] > 0                                          # [B, L] not padding
    assert np.array_equal(sub_b["segment_ids"], full_b["segment_ids"])
    assert np.array_equal(np.asarray(ids)[sub_b["input_ids"]][real], full_b["input_ids"][real])
    assert np.array_equal(sub_b["position_ids"], full_b["position_ids"])  # the rope index found the images
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ms.set_seed(0)
        full = MindVLModel(cfg)
        sub = MindVLModel(sub_cfg)
        tensors = model_tensors(full)
        emb = [k for k, t in tensors.items() if t.shape[0] == cfg.text.vocab_size]
        assert emb == ["model.embed_tokens.weight"]  # tied head
        load_into(sub, {k: RawTensor.of(t.float32()[ids]) if k in emb else t for k, t in tensors.items()})
        ref = full(*[Tensor(full_b[k]) for k in INPUT_NAMES])[0].asnumpy()      # [B, L, 151936]
        got = sub(*[Tensor(sub_b[k]) for k in INPUT_NAMES])[0].asnumpy()       # [B, L, V]
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    np.testing.assert_allclose(got[real], ref[..., ids][real], rtol=1e-5, atol=1e-5)


def test_init_from_run_builds_batches_for_the_checkpoints_config(demo_data, tmp_path):
    """A run with init_from trains the checkpoint's model, so its batches use the checkpoint's config (here
    the subset's token ids), not a YAML `model:` section over the full vocabulary."""
    from mindvl_ms.config.train import load_run_config
    from mindvl_ms.train.build import checkpoint_model_config

    _, _, sub_dir, _, _ = demo_data
    tiny = read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    sub_cfg = load(MindVLConfig, copy.deepcopy(tiny), "tiny.yaml")
    restrict_model_config(sub_cfg, load_tokenizer(sub_dir))
    save_pretrained(MindVLModel(sub_cfg), str(tmp_path / "ck"))
    run_cfg = load_run_config(data={"model": tiny, "init_from": str(tmp_path / "ck"),
                                    "stages": [{"name": "sft", "max_steps": 1}]})
    got = checkpoint_model_config(run_cfg)
    assert got.model == sub_cfg and got.model.image_token_id != run_cfg.model.image_token_id
    assert run_cfg.model.text.vocab_size == 151936 and got.stages == run_cfg.stages  # the caller's config untouched


def test_demo_vocab_field(tmp_path):
    """`demo.vocab`: "full" leaves the model and tokenizer alone, "data" restricts both (to what the train
    sources and held-out prompts use), anything else is an error naming the choices."""
    from mindvl_ms.recipes.demo.config import config_path, load_demo_config
    from mindvl_ms.recipes.demo.prepare import restrict_vocab

    data = tmp_path / "data"
    info = write_demo_data(str(data), seed=0, sizes={"vqa": (6, 3), "ocr": (2, 2), "grounding": (2, 2)},
                           progress=False)
    cfg, demo = load_demo_config(config_path(True), str(data))
    assert demo["vocab"] == "data" and cfg.model.text.vocab_size == 151936  # nothing written yet
    with pytest.raises(ValueError, match="demo.vocab 'all': expected 'full'"):
        restrict_vocab(cfg, {"vocab": "all"}, str(data), [])
    assert restrict_vocab(cfg, {"vocab": "full"}, str(data), []) == {"mode": "full", "size": 151936}
    assert cfg.data.tokenizer == "" and not (data / "tokenizer").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the held-out files are read as benchmarks: task/metric are known fields
        got = restrict_vocab(cfg, demo, str(data), list(info["files"]["heldout"].values()))
    ids = json.load(open(data / "tokenizer" / "vocab_subset.json"))["ids"]
    assert got == {"mode": "data", "size": len(ids), "of": 151936} and cfg.model.text.vocab_size == len(ids)
    assert cfg.data.tokenizer == str(data / "tokenizer")
    assert load_demo_config(config_path(True), str(data))[0].model == cfg.model  # a later load applies it
