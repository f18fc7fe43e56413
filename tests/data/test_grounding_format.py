"""Grounding coordinate formats (openPangu-VL report 5.2.3: zero-padded "008" scores best): formatting and
parsing round trips in every format, the default (`data.grounding.coord_format: zero_pad`; `plain` in the
demo), the processor writing the configured format before tokenizing, and a checkpoint's processor files
recording it (a Hugging Face checkpoint, which records none, keeps plain). No MindSpore graphs.

    python -m pytest -q tests/data/test_grounding_format.py
"""
import json
import os
import shutil

import pytest
from transformers import Qwen2VLImageProcessor

from mindvl_ms.config.base import ConfigError, load, read_yaml
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.grounding import GroundingConfig
from mindvl_ms.config.train import load_run_config
from mindvl_ms.data import processor_files as pf
from mindvl_ms.data.grounding import (GroundingError, Shape, format_box, format_object, parse_grounding,
                                      reformat_grounding, reformat_messages)
from mindvl_ms.data.processor import MindVLProcessor, carry_processor, processor_of, save_processor
from mindvl_ms.data.tokenizer import default_tokenizer_dir
from tests.support.paths import ROOT

SHAPES = [Shape("box", [(8, 0), (100, 999)]), Shape("point", [(5, 67)]),
          Shape("quad", [(1, 2), (30, 2), (30, 40), (1, 40)])]
PLAIN = ("a <|object_ref_start|>cat<|object_ref_end|><|box_start|>(8,0),(100,999)<|box_end|> and "
         "<|point_start|>(5,67)<|point_end|>")
PADDED = ("a <|object_ref_start|>cat<|object_ref_end|><|box_start|>(008,000),(100,999)<|box_end|> and "
          "<|point_start|>(005,067)<|point_end|>")


def _points(text):
    return [(o.ref, [(s.kind, s.points) for s in o.shapes]) for o in parse_grounding(text, strict=True)]


@pytest.mark.parametrize("fmt", ["zero_pad", "plain", "digits"])
def test_format_parse_round_trip(fmt):
    text = format_object("cat", SHAPES, fmt)
    assert _points(text) == [("cat", [(s.kind, s.points) for s in SHAPES])]
    assert reformat_grounding(text, fmt) == text                       # already in the format: unchanged
    for other in ("zero_pad", "plain", "digits"):                      # through any other format and back
        assert reformat_grounding(reformat_grounding(text, other), fmt) == text
        assert _points(reformat_grounding(text, other)) == _points(text)


def test_padded_and_plain_texts():
    assert format_box(8, 0, 100, 999, "zero_pad") == "<|box_start|>(008,000),(100,999)<|box_end|>"
    assert format_box(8, 0, 100, 999) == "<|box_start|>(8,0),(100,999)<|box_end|>"  # format_* default: as written
    assert reformat_grounding(PLAIN, "zero_pad") == PADDED and reformat_grounding(PADDED, "plain") == PLAIN
    assert _points(PLAIN) == _points(PADDED)                           # parse reads both, always
    # malformed labels and plain text stay as written (validate names them); other numbers are not touched
    odd = "3 of 10 <|box_start|>(9,9),(1,1)<|box_end|><|point_start|>(1,2,3)<|point_end|><|quad_start|>(1,2)"
    assert reformat_grounding(odd, "zero_pad") == odd
    msgs = [{"role": "user", "content": "<image>\nAt <|point_start|>(5,67)<|point_end|>?"},
            {"role": "assistant", "content": PLAIN}]
    out = reformat_messages(msgs, "zero_pad")
    assert out[0]["content"].endswith("(005,067)<|point_end|>?") and out[1]["content"] == PADDED
    assert msgs[1]["content"] == PLAIN                                  # the input is kept
    with pytest.raises(GroundingError, match="coord_format 'padded'"):
        reformat_grounding(PLAIN, "padded")


def test_the_default_is_zero_pad_and_the_demo_keeps_plain():
    assert DataConfig().grounding.coord_format == "zero_pad"
    pangu = load_run_config(os.path.join(ROOT, "configs", "run", "openpangu-vl-7b-64npu.yaml"))
    assert pangu.data.grounding.coord_format == "zero_pad"
    for name in ("quick", "full", "train", "post", "post_train"):  # the demo's numbers were trained on plain boxes
        data = read_yaml(os.path.join(ROOT, "configs", "demo", f"{name}.yaml"))["data"]
        assert load(DataConfig, data).grounding.coord_format == "plain", name
    with pytest.raises(ConfigError, match="coord_format 'padded': expected one of zero_pad, plain, digits"):
        load(DataConfig, {"grounding": {"coord_format": "padded"}}, source="d.yaml")


def test_the_processor_writes_the_configured_format():
    msgs = [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": PLAIN}]
    padded = MindVLProcessor(config=DataConfig(system_prompt=""))
    plain = MindVLProcessor(config=load(DataConfig, {"system_prompt": "", "grounding": {"coord_format": "plain"}}))
    for proc, text in ((padded, PADDED), (plain, PLAIN)):
        ids, labels = proc.encode(msgs, [])
        assert proc.decode(ids, skip_special_tokens=False) == \
            f"<|im_start|>user\nWhere?<|im_end|>\n<|im_start|>assistant\n{text}<|im_end|>\n"
        assert proc.decode(labels[labels >= 0], skip_special_tokens=False) == text + "<|im_end|>"
        assert proc.count_tokens(msgs, []) == len(ids)  # the packer counts what the loader encodes
        ids2, _ = proc.encode([dict(m, content=PADDED if m["role"] == "assistant" else m["content"]) for m in msgs], [])
        assert (ids2 == ids).all()                                        # either input format trains the same


def test_checkpoints_record_their_format_and_hf_ones_keep_plain(tmp_path):
    ours = str(tmp_path / "ours")
    os.makedirs(ours)
    save_processor(ours, data_cfg=DataConfig())
    assert json.load(open(os.path.join(ours, pf.PREPROCESSOR)))["grounding"] == {"coord_format": "zero_pad"}
    assert MindVLProcessor.from_pretrained(ours).config.grounding.coord_format == "zero_pad"
    carried = str(tmp_path / "carried")                    # merge / export / convert carry the record
    os.makedirs(carried)
    carry_processor(carried, ours)
    assert processor_of(carried).config.grounding.coord_format == "zero_pad"
    # a Hugging Face checkpoint's processor files (Qwen2.5-VL: transformers' image processor, its tokenizer)
    hf = str(tmp_path / "hf")
    Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12544).save_pretrained(hf)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(default_tokenizer_dir(), f), os.path.join(hf, f))
    assert pf.read_grounding_config(hf) == GroundingConfig(coord_format="plain")
    proc = MindVLProcessor.from_pretrained(hf)
    assert proc.config.grounding.coord_format == "plain" and proc.image_config.max_pixels == 12544
    out = proc(messages=[{"role": "user", "content": "What is at <|point_start|>(5,67)<|point_end|>?"}])
    assert "(5,67)" in proc.decode(out["input_ids"][0], skip_special_tokens=False)
    converted = str(tmp_path / "converted")                # `mindvl convert` writes the HF files it read
    os.makedirs(converted)
    carry_processor(converted, hf)
    assert processor_of(converted).config.grounding.coord_format == "plain"
    os.remove(os.path.join(hf, "tokenizer.json"))          # no complete set: the processor it records, plain
    os.remove(os.path.join(converted, pf.PREPROCESSOR))
    carry_processor(converted, hf)
    assert json.load(open(os.path.join(converted, pf.PREPROCESSOR)))["grounding"] == {"coord_format": "plain"}
