"""Preference and RL-prompt lines: schema errors with line numbers through `mindvl data validate`, the
same image/grounding checks as SFT lines, and the token layout of prompt + response."""
import json

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.config.data import DataConfig
from mindvl_ms.data.preference import encode_pair, encode_response, parse_post, read_post_file
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import SampleError
from mindvl_ms.data.validate import validate_file

BOX = "<|box_start|>(10,20),(300,400)<|box_end|>"


def _lines(tmp_path):
    (tmp_path / "img").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(
        tmp_path / "img" / "ok.png")
    user = [{"role": "user", "content": "<image>Where?"}]
    rows = [
        {"images": ["img/ok.png"], "messages": user, "chosen": BOX, "rejected": "nowhere"},            # 1 ok
        {"images": ["img/ok.png"], "messages": user, "answer": BOX, "reward": "grounding_iou"},        # 2 ok
        {"images": ["img/ok.png"], "messages": user, "chosen": "a"},                                   # 3 no rejected
        {"images": ["img/ok.png"], "messages": user, "chosen": "a", "answer": "b"},                    # 4 mixed kinds
        {"images": ["img/ok.png"], "messages": user + [{"role": "assistant", "content": "x"}],
         "answer": "x"},                                                                                # 5 ends with assistant
        {"images": ["img/missing.png"], "messages": user, "answer": "2"},                              # 6 missing image
        {"images": ["img/ok.png"], "messages": user, "chosen": "<|box_start|>(1,2),(3,1200)<|box_end|>",
         "rejected": "b"},                                                                              # 7 grounding
        {"messages": user, "answer": "2"},                                                              # 8 count mismatch
        {"images": ["img/ok.png"], "messages": user, "chosen": "same", "rejected": "same"},             # 9 identical
        {"images": ["img/ok.png"], "messages": user, "answer": "2", "rewrd": "x"},                      # 10 typo
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},                             # 11 ok, text only
    ]
    path = tmp_path / "post.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_validate_reports_post_lines(tmp_path):
    rep = validate_file(_lines(tmp_path), workers=1, progress=False)
    by_line = {}
    for e in rep["errors"]:
        by_line.setdefault(e["line"], []).append(e["reason"])
    assert set(by_line) == {3, 4, 5, 6, 7, 8, 9, 10}
    assert by_line[6] == ["missing image"] and by_line[7] == ["grounding"]
    assert by_line[8] == ["image count mismatch"]
    assert all(r == ["schema"] for k, r in by_line.items() if k in (3, 4, 5, 9, 10))
    assert "rewrd" in next(e["detail"] for e in rep["errors"] if e["line"] == 10)


def test_read_post_file_kind_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}) + "\n")
    pairs = read_post_file(str(p), "preference")
    assert pairs[0].chosen == "a" and pairs[0].rejected == "b" and pairs[0].kind == "preference"
    with pytest.raises(SampleError, match="expected a prompt line"):
        read_post_file(str(p), "prompt")
    with pytest.raises(SampleError, match="must end with a user turn"):
        parse_post({"messages": [{"role": "assistant", "content": "q"}], "answer": "a"}, "f", 3)


def test_encode_response_layout():
    prompt = {"input_ids": np.array([5, 6, 7]), "pixel_values": None, "image_grid_thw": None}
    s = encode_response(prompt, [11, 12], end=[99])
    np.testing.assert_array_equal(s["input_ids"], [5, 6, 7, 11, 12, 99])
    np.testing.assert_array_equal(s["labels"], [-100, -100, -100, 11, 12, 99])
    s = encode_response(prompt, [11, 99], end=[99])  # already ends with the end token: not doubled
    np.testing.assert_array_equal(s["input_ids"], [5, 6, 7, 11, 99])


def test_post_data_factory_reads_files(tmp_path):
    """The default data of a dpo/grpo stage: data.sources through the processor (real tokenizer), NTP rows
    from dpo.ntp_sources; chosen and rejected share the prompt's tokens and pixels."""
    from mindvl_ms.config.train import load_run_config
    from mindvl_ms.data.processor import MindVLProcessor
    from mindvl_ms.infer.rollout import EngineSampler
    from mindvl_ms.train.post.sources import post_data_factory

    path = _lines(tmp_path)
    lines = open(path).read().splitlines()
    (tmp_path / "pairs.jsonl").write_text(lines[0] + "\n")
    (tmp_path / "prompts.jsonl").write_text(lines[1] + "\n" + lines[10] + "\n")
    sft = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp_path / "sft.jsonl").write_text(json.dumps(sft) + "\n")
    stage = {"name": "d", "type": "dpo", "epochs": None, "max_steps": 1, "global_batch_size": 1,
             "data": {"sources": [{"path": str(tmp_path / "pairs.jsonl")}]},
             "dpo": {"ntp_sources": [str(tmp_path / "sft.jsonl")], "ntp_ratio": 1.0}}
    cfg = load_run_config(data={"stages": [stage, dict(stage, name="g", type="grpo", dpo={},
                                                       data={"sources": [{"path": str(tmp_path / "prompts.jsonl")}]})]})
    proc = MindVLProcessor()
    src = post_data_factory(cfg, cfg.stages[0], 0, None)
    (c, r), = src.pairs
    tok = proc.tokenizer
    end = tok.token_to_id("<|im_end|>")
    n_c, n_r = len(tok.encode(BOX)) + 1, len(tok.encode("nowhere")) + 1
    prompt_len = len(c["input_ids"]) - n_c
    np.testing.assert_array_equal(c["input_ids"][:prompt_len], r["input_ids"][:prompt_len])
    assert proc.decode(c["input_ids"][prompt_len:], skip_special_tokens=False) == BOX + "<|im_end|>"
    assert (c["labels"] != -100).sum() == n_c and (r["labels"] != -100).sum() == n_r and c["labels"][-1] == end
    assert c["pixel_values"] is r["pixel_values"] and c["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert proc.decode(c["input_ids"][:prompt_len], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert len(src.ntp.rows) == 1 and (src.ntp.rows[0][0]["labels"] != -100).sum() > 0
    g = post_data_factory(cfg, cfg.stages[1], 1, None, EngineSampler())
    assert [p["answer"] for p in g.prompts] == [BOX, "4"] and g.prompts[1]["pixel_values"] is None
    assert g.prompts[0]["reward"] == "grounding_iou" and g.decode([end]) == "" and end in g.eos


def test_sft_lines_serve_as_prompts(tmp_path):
    sft = {"id": "s", "messages": [{"role": "user", "content": "Where is the cat?"},
                                   {"role": "assistant", "content": BOX}]}
    bad = {"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}
    p = tmp_path / "sft.jsonl"
    p.write_text(json.dumps(sft) + "\n")
    (s,) = read_post_file(str(p), "prompt")
    assert s.kind == "prompt" and s.answer == BOX and [m["role"] for m in s.messages] == ["user"]
    for b in (bad, dict(sft, messages=sft["messages"][1:])):  # two answers; an answer without a question
        p.write_text(json.dumps(b) + "\n")
        with pytest.raises(SampleError, match="must end with a user turn followed by"):
            read_post_file(str(p), "prompt")
    with pytest.raises(SampleError):
        p.write_text(json.dumps(sft) + "\n")
        read_post_file(str(p), "preference")


def test_a_pair_with_sampled_ids_trains_on_the_ids():
    """A rollout's pair carries the token ids it sampled: DPO's samples hold exactly them (+ <|im_end|>),
    not the decoded text encoded again, which can give other tokens ('(' then 'circle' sampled decodes to
    '(circle'); a pair without ids encodes its texts. Ids come both or neither, as lists of ints >= 0."""
    proc = MindVLProcessor(config=DataConfig())
    tok = proc.tokenizer
    sampled = tok.encode("(") + tok.encode("circle")
    assert tok.encode("(circle") != sampled  # the text does not give the sampled tokens back
    user = [{"role": "user", "content": "Which shape?"}]
    line = {"messages": user, "chosen": "(circle", "rejected": "square", "chosen_ids": sampled,
            "rejected_ids": tok.encode("square")}
    prompt = {"input_ids": np.array([7, 8, 9]), "pixel_values": None, "image_grid_thw": None}
    end = tok.token_to_id("<|im_end|>")
    chosen, rejected = encode_pair(proc, prompt, parse_post(line, "p.jsonl", 1))
    assert chosen["input_ids"].tolist() == [7, 8, 9] + sampled + [end]
    assert rejected["input_ids"].tolist() == [7, 8, 9] + tok.encode("square") + [end]
    plain = {k: v for k, v in line.items() if not k.endswith("_ids")}
    chosen, _ = encode_pair(proc, prompt, parse_post(plain, "p.jsonl", 1))
    assert chosen["input_ids"].tolist() == [7, 8, 9] + tok.encode("(circle") + [end]
    for bad, msg in (({"chosen_ids": sampled}, "give both or neither"),
                     ({"chosen_ids": [-1], "rejected_ids": [3]}, "integers >= 0"),
                     ({"chosen_ids": [], "rejected_ids": [3]}, "non-empty list"),
                     ({"chosen_ids": "1 2", "rejected_ids": [3]}, "list of token ids")):
        with pytest.raises(SampleError, match=msg):
            parse_post({**plain, **bad}, "p.jsonl", 4)
