"""`mindvl rollout`: k candidates per prompt from a checkpoint, scored by a verifier named in
`module:function` form, pairs written by the report's rule (one above --high, one below --low), the output
a valid preference file, and the same file again from the same seed."""
import json
import os
import sys

import mindspore as ms
import numpy as np
import pytest
from PIL import Image

from mindvl_ms.cli import main
from mindvl_ms.config import MindVLConfig
from mindvl_ms.config.base import load, read_yaml
from mindvl_ms.data.preference import read_post_file
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.validate import validate_file
from mindvl_ms.infer import generate as generate_module
from mindvl_ms.infer.generate import load_model, stop_token_ids
from mindvl_ms.infer.rollout import choose_pair, response_text
from mindvl_ms.train.post.rewards import grounding_iou_reward
from tests.support import post as H
from tests.support.paths import ROOT


def test_choose_pair_rule():
    assert choose_pair([0.2, 0.9, 0.1, 0.9], 0.75, 0.25) == (1, 2)   # first best, first worst
    assert choose_pair([0.5, 0.9, 0.3], 0.75, 0.25) is None          # nothing below low
    assert choose_pair([0.75, 0.0], 0.75, 0.25) is None              # strictly above high


@pytest.fixture()
def ckpt(tmp_path):
    from mindvl_ms import MindVLForConditionalGeneration

    d = read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    d["vision"].update(depth=1, fullatt_block_indexes=[0], hidden_size=32, intermediate_size=32, num_heads=2,
                       out_hidden_size=32)
    d["text"].update(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, mrope_section=[2, 3, 3], max_position_embeddings=128)
    cfg = load(MindVLConfig, d, "tiny.yaml")
    path = str(tmp_path / "ckpt")
    MindVLForConditionalGeneration(cfg).save_pretrained(path)
    return path


def test_rollout_command_writes_valid_reproducible_pairs(tmp_path, ckpt, monkeypatch, capsys):
    """The command twice on one loaded model (its weights as read from --ckpt; the engine's graphs compiled
    once): the second file is the first, from the seed alone."""
    monkeypatch.setattr(sys.modules["mindvl_ms.cli"], "COMMAND_MODULES", ["mindvl_ms.cli.rollout"])
    loaded = {}

    def load_once(path, fp16=False):
        if path not in loaded:
            loaded[path] = load_model(path, fp16)
        return loaded[path]
    monkeypatch.setattr(generate_module, "load_model", load_once)
    (tmp_path / "img").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8)).save(
        tmp_path / "img" / "a.png")
    lines = [{"id": f"q{i}", "images": ["img/a.png"], "answer": "x", "reward": "tests.support.post:char_parity",
              "messages": [{"role": "user", "content": f"<image>question {i}"}]} for i in range(4)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    outs = []
    for run in range(2):
        out = tmp_path / "out" / f"pairs{run}.jsonl"
        ms.set_context(mode=ms.PYNATIVE_MODE)  # the command compiles graphs whatever the process's mode
        try:
            assert main(["rollout", "--ckpt", ckpt, "--data", str(data), "--out", str(out), "-k", "4",
                         "--max-new-tokens", "6", "--seed", "3"]) == 0
            assert ms.get_context("mode") == ms.GRAPH_MODE
        finally:
            ms.set_context(mode=ms.GRAPH_MODE)
        summary = json.loads(capsys.readouterr().out)
        outs.append(out.read_text())
    assert outs[0] == outs[1]                                  # reproducible from the seed
    pairs = [json.loads(x) for x in outs[0].splitlines()]
    assert summary["prompts"] == 4 and summary["pairs"] == len(pairs) >= 1
    for p in pairs:
        assert H.char_parity(p["chosen"], "x") == 1.0 and H.char_parity(p["rejected"], "x") == 0.0
        assert sorted(p["meta"]["scores"]) != [p["meta"]["scores"][0]] * 4
        assert p["images"] == ["../img/a.png"]
        assert p["chosen_ids"] and p["rejected_ids"] != p["chosen_ids"]  # the sampled tokens, eos stripped
        assert all(isinstance(t, int) and t >= 0 for t in p["chosen_ids"] + p["rejected_ids"])
    rep = validate_file(str(tmp_path / "out" / "pairs0.jsonl"), workers=1, progress=False)
    assert rep["num_bad"] == 0, rep["errors"]
    read = read_post_file(str(tmp_path / "out" / "pairs0.jsonl"), "preference")
    assert [(s.chosen_ids, s.rejected_ids) for s in read] == [(p["chosen_ids"], p["rejected_ids"]) for p in pairs]
    assert main(["rollout", "--ckpt", ckpt, "--data", str(data), "--out", str(out), "-k", "1"]) == 2
    assert "at least 2 candidates" in capsys.readouterr().err


def test_sampled_boxes_reach_the_verifier_with_their_tags():
    """Rollout and GRPO texts keep `<|box_start|>`/`<|box_end|>` (special tokens of the Qwen3 vocabulary),
    so grounding_iou scores a sampled box; plain skip-special decoding would drop the tags and score 0."""
    proc = MindVLProcessor()
    tok, eos = proc.tokenizer, stop_token_ids(proc)
    box = "<|box_start|>(100,200),(300,400)<|box_end|>"
    ids = tok.encode(box) + [eos[0]]
    assert tok.decode(ids, skip_special_tokens=True) == "(100,200),(300,400)"
    assert response_text(proc, ids, eos) == box
    assert grounding_iou_reward(response_text(proc, ids, eos), "<|box_start|>(100,200),(300,300)<|box_end|>") == \
        pytest.approx(0.5)
