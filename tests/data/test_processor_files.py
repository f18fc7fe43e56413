"""Checkpoints carry their processor: tokenizer files, preprocessor_config.json, chat_template.json.

- the Jinja template renders exactly `data.processor.render` (rendered by transformers' own
  apply_chat_template), for empty, custom and default system prompts;
- a training checkpoint (the trainer's writer, the stage's `data` overrides applied) records the pixel
  limits and the system prompt; merge and convert keep them;
- `mindvl generate` on that checkpoint builds the prompt with the saved limits and system prompt (checked
  against ids assembled by hand) and produces the same tokens as the `mindvl eval` path;
- answers print with their grounding tags.
"""
import io
import json
import os
from contextlib import redirect_stdout

import numpy as np
import pytest
from PIL import Image

from mindvl_ms.data import processor_files as pf
from mindvl_ms.config.base import load
from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.data.processor import MindVLProcessor, carry_processor, processor_of, render, save_processor

from tests.support.paths import ROOT  # noqa: E402
CONVS = [
    [{"role": "user", "content": "<image>\nWhat is written here?"}, {"role": "assistant", "content": "HELLO"},
     {"role": "user", "content": "And <image> here?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Where is the square?"},
     {"role": "assistant", "content": "<|box_start|>(45,45),(418,384)<|box_end|>"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """transformers' tokenizer loaded from the files `save_processor` writes (they do not depend on the
    system prompt, which only the chat template carries): loaded once for the template tests."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_processor(str(d), data_cfg=DataConfig())
    return AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("system_prompt", ["", "You are a helpful assistant.", 'Say "ok".\nThen stop. é 😀'])
def test_template_renders_like_the_processor(tmp_path, system_prompt, hf_tokenizer):
    save_processor(str(tmp_path), data_cfg=DataConfig(system_prompt=system_prompt))
    tok = hf_tokenizer
    template = json.load(open(tmp_path / pf.CHAT_TEMPLATE))["chat_template"]
    for conv in CONVS:
        for gen in (False, True):
            ours = render(conv, system_prompt, add_generation_prompt=gen)[0]
            theirs = tok.apply_chat_template(conv, chat_template=template, add_generation_prompt=gen, tokenize=False)
            assert theirs == ours
    # transformers-style content lists render like <image> placeholders
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is written here?"}]}]
    assert tok.apply_chat_template(parts, chat_template=template, tokenize=False) == \
        render([{"role": "user", "content": "<image>\nWhat is written here?"}], system_prompt)[0]


def test_round_trip_and_transformers_reads_the_pixel_limits(tmp_path):
    from transformers import Qwen2VLImageProcessor

    cfg = DataConfig(system_prompt="", image=ImageConfig(min_pixels=12544, max_pixels=12544))
    written = save_processor(str(tmp_path), data_cfg=cfg)
    assert set(written) == {"tokenizer.json", "tokenizer_config.json", pf.PREPROCESSOR, pf.CHAT_TEMPLATE}
    proc = MindVLProcessor.from_pretrained(str(tmp_path))
    assert proc.config.system_prompt == "" and proc.image_config == cfg.image
    assert pf.read_image_config(str(tmp_path)) == cfg.image
    ip = Qwen2VLImageProcessor.from_pretrained(str(tmp_path))
    assert (ip.min_pixels, ip.max_pixels, ip.patch_size, ip.merge_size) == (12544, 12544, 14, 2)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 120, 3), dtype=np.uint8))
    ours = proc(messages=[{"role": "user", "content": "<image>\nx"}], images=[img])
    np.testing.assert_allclose(ours["pixel_values"], ip(images=[img], return_tensors="np")["pixel_values"], atol=1e-5)
    # a directory with only pixel limits / system prompt (no tokenizer): processor_of still reads them
    os.remove(tmp_path / "tokenizer.json")
    p2 = processor_of(str(tmp_path))
    assert p2.config.system_prompt == "" and p2.image_config.max_pixels == 12544


def test_decode_answer_keeps_grounding_tags():
    from mindvl_ms.infer.generate import decode_answer

    proc = MindVLProcessor()
    tok = proc.tokenizer
    ids = tok.encode("<|box_start|>(45,45),(418,384)<|box_end|> é<|vision_start|><|im_end|>")
    assert decode_answer(proc, ids) == "<|box_start|>(45,45),(418,384)<|box_end|> é"
    assert proc.decode(ids) == "(45,45),(418,384) é"  # what the old streaming printed
    assert decode_answer(proc, ids, show_special=True).endswith("<|vision_start|><|im_end|>")


# ------------------------------------------------------------------------------------------------------
# a checkpoint as training writes it, then generate / eval / merge / convert on it

@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    """A random tiny MindVL saved through the trainer's checkpoint writer; the run trains without a system
    turn at 112x112-equivalent pixels (as the demo does), the stage overriding the run's pixel limit."""
    from mindvl_ms.checkpoint import trainer_state as ts
    from mindvl_ms.config.train import load_run_config
    from mindvl_ms.models.mindvl import MindVLModel
    from mindvl_ms.train.build import processor_writer

    run = load_run_config(os.path.join(ROOT, "configs", "stage", "tiny-cpu.yaml"),
                          ["data.system_prompt=''", "stages.2.data={image: {min_pixels: 12544, max_pixels: 12544}}"])
    stage = run.stages[2]
    model = MindVLModel(run.model)
    out = tmp_path_factory.mktemp("run")
    path = ts.save_checkpoint(str(out / stage.name / "checkpoint-000001"), model, {}, {"stage": stage.name},
                              str(out), extra=processor_writer(run, stage, model))
    return path, model


def test_training_checkpoint_records_the_processor(trained_ckpt):
    path, _ = trained_ckpt
    files = set(os.listdir(path))
    assert {"tokenizer.json", pf.PREPROCESSOR, pf.CHAT_TEMPLATE, "config.json", "trainer_state.json"} <= files
    pre = json.load(open(os.path.join(path, pf.PREPROCESSOR)))
    assert (pre["min_pixels"], pre["max_pixels"]) == (12544, 12544)  # the stage's override
    assert pf.read_system_prompt(path) == ""


def test_generate_uses_the_saved_processor_and_matches_eval(trained_ckpt, tmp_path, monkeypatch):
    """`mindvl generate` and `mindvl eval` on the checkpoint: the same prompt ids (no system turn, 16
    image tokens: 12544 pixels / 28^2) and the same generated ids."""
    import mindvl_ms.infer.generate as G
    from mindvl_ms.cli import main
    from mindvl_ms.eval.benchmark import evaluate

    path, model = trained_ckpt
    monkeypatch.setattr(G, "load_model", lambda ckpt, fp16=False: model)  # one model: one set of graphs
    calls = []
    real = G.generate

    def recording(m, samples, *a, **kw):
        out = real(m, samples, *a, **kw)
        calls.extend((np.asarray(s["input_ids"]).tolist(), o) for s, o in zip(samples, out))
        return out

    monkeypatch.setattr(G, "generate", recording)
    img_path = tmp_path / "square.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(img_path)
    question = "Where is the purple square?"
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["generate", "--ckpt", path, "--image", str(img_path), "--prompt", question,
                     "--max-new-tokens", "6"]) == 0
    (cli_prompt, cli_ids), = calls
    tok = MindVLProcessor().tokenizer
    pad = tok.token_to_id("<|image_pad|>")
    expected = (tok.encode("<|im_start|>user\n<|vision_start|>") + [pad] * 16
                + tok.encode(f"<|vision_end|>\n{question}<|im_end|>\n<|im_start|>assistant\n"))
    assert cli_prompt == expected
    assert buf.getvalue().strip() == G.decode_answer(G.load_processor(path), cli_ids).strip()

    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "q1", "images": [img_path.name], "task": "grounding",
                                 "messages": [{"role": "user", "content": f"<image>\n{question}"},
                                              {"role": "assistant", "content": "x"}]}) + "\n")
    calls.clear()
    res = evaluate(path, str(bench), str(tmp_path / "eval"), max_new_tokens=6, progress=False)
    assert (res["min_pixels"], res["max_pixels"]) == (12544, 12544)
    (eval_prompt, eval_ids), = calls
    assert eval_prompt == cli_prompt and eval_ids == cli_ids


def test_merge_and_convert_keep_the_processor(trained_ckpt, tmp_path):
    from mindvl_ms.cli.convert import write_processor
    from mindvl_ms.checkpoint.hf import convert
    from mindvl_ms.checkpoint.merge import merge

    path, _ = trained_ckpt
    bare = tmp_path / "bare"  # the same weights without processor files
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        os.link(os.path.join(path, f), bare / f)
    rec = merge([str(bare), path], str(tmp_path / "merged"), progress=False)
    assert rec["processor_from"] == os.path.abspath(path)  # the first input has none: taken from the second
    merged = str(tmp_path / "merged")
    assert pf.read_system_prompt(merged) == "" and pf.read_image_config(merged).max_pixels == 12544
    rec = merge([path, str(bare)], str(tmp_path / "merged2"), progress=False)
    assert rec["processor_from"] == os.path.abspath(path) and pf.CHAT_TEMPLATE in rec["files_copied_from_first_input"]
    hf = str(tmp_path / "hf")
    convert(merged, hf, to="hf")
    write_processor(hf, merged)
    back = str(tmp_path / "back")
    convert(hf, back, to="native")
    write_processor(back, hf)
    for d in (hf, back):
        assert pf.read_system_prompt(d) == "" and pf.read_image_config(d).min_pixels == 12544
        assert MindVLProcessor.from_pretrained(d).config.system_prompt == ""
    carry_processor(str(bare), None)  # no source: the defaults
    assert pf.read_system_prompt(str(bare)) == DataConfig().system_prompt
    assert load(ImageConfig, {}) == pf.read_image_config(str(bare))
