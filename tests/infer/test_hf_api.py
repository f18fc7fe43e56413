"""Hugging Face style calls: `processor(messages=, images=)`, `model(**inputs)`, `model.generate(**inputs)`.

Reference: a tiny random transformers Qwen2_5_VLForConditionalGeneration with the real Qwen3 vocabulary
(so the real tokenizer's ids fit) and transformers' own processing, loaded from the processor files
mindvl-ms writes into the checkpoint: AutoTokenizer (tokenizer files), Qwen2VLImageProcessor
(preprocessor_config.json) and the Jinja chat template (chat_template.json) rendered by
`apply_chat_template`; image pads are expanded as Qwen2_5_VLProcessor does (its class needs torchvision
for its video part, which is not installed). The keyword path must give the positional path's numbers exactly and
transformers' within 1e-4.
"""
import numpy as np
import pytest
import torch
from PIL import Image

from mindvl_ms.config.data import DataConfig, ImageConfig
from mindvl_ms.data.processor import MindVLProcessor, save_processor
from mindvl_ms.data.collate import build_model_inputs, model_args
from mindvl_ms import MindVLForConditionalGeneration
from mindvl_ms.infer import hf_api

VOCAB = 151936
IMAGE, VIDEO, VSTART, VEND = 151655, 151656, 151652, 151653
IM_END, PAD = 151645, 151643
SYSTEM = "Answer briefly."


def _tiny_hf(path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, hidden_act="silu"),
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                         tie_word_embeddings=False, rms_norm_eps=1e-6),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if "norm" in name or "ln_q" in name else 0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import json

    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    path = str(tmp_path_factory.mktemp("hfapi") / "ckpt")
    hf = _tiny_hf(path)
    # the processor files of a checkpoint trained at 56x56..112x112 pixels with a custom system prompt
    save_processor(path, data_cfg=DataConfig(system_prompt=SYSTEM, image=ImageConfig(min_pixels=3136,
                                                                                      max_pixels=12544)))
    proc = MindVLProcessor.from_pretrained(path)
    model = MindVLForConditionalGeneration.from_pretrained(path)
    with open(f"{path}/chat_template.json") as f:
        template = json.load(f)["chat_template"]
    hf_proc = (AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessor.from_pretrained(path), template)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (90, 150, 3), dtype=np.uint8))
    return path, hf, hf_proc, proc, model, img


def _hf_inputs(hf_proc, convs, images, add_generation_prompt=True):
    """transformers' processing of a batch of conversations (left padding), as Qwen2_5_VLProcessor does it."""
    tok, ip, template = hf_proc
    convs = convs if isinstance(convs[0], list) else [convs]
    texts = [tok.apply_chat_template(c, chat_template=template, add_generation_prompt=add_generation_prompt,
                                     tokenize=False) for c in convs]
    out = {}
    if images:
        out = dict(ip(images=images, return_tensors="pt"))
        counts = iter((out["image_grid_thw"].prod(-1) // ip.merge_size ** 2).tolist())
        expanded = []
        for t in texts:
            while "<|image_pad|>" in t:
                t = t.replace("<|image_pad|>", "<|placeholder|>" * next(counts), 1)
            expanded.append(t.replace("<|placeholder|>", "<|image_pad|>"))
        texts = expanded
    tok.padding_side = "left"
    out.update(tok(texts, return_tensors="pt", padding=True))
    return out


def test_processor_call_matches_transformers_processor(setup):
    _, _, hf_proc, proc, _, img = setup
    assert proc.config.system_prompt == SYSTEM and proc.image_config.max_pixels == 12544
    msgs = [{"role": "user", "content": "<image>\nWhat is in the picture?"}]
    ours = proc(messages=msgs, images=[img])
    ref = _hf_inputs(hf_proc, msgs, [img])
    np.testing.assert_array_equal(ours["input_ids"], ref["input_ids"].numpy())
    np.testing.assert_array_equal(ours["attention_mask"], ref["attention_mask"].numpy())
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"].numpy())
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"].numpy(), atol=1e-5)
    assert ours["image_grid_thw"].tolist() == [[1, 6, 10]]  # 90x150 -> 84x140 inside max_pixels 12544
    ms_out = proc(messages=msgs, images=[img], return_tensors="ms")
    assert type(ms_out["input_ids"]).__name__ == "Tensor"
    np.testing.assert_array_equal(ms_out["input_ids"].asnumpy(), ours["input_ids"])
    with pytest.raises(ValueError, match="return_tensors"):
        proc(messages=msgs, images=[img], return_tensors="pt")


def test_model_call_logits_and_loss(setup):
    _, hf, hf_proc, proc, model, img = setup
    msgs = [{"role": "user", "content": "<image>\nWhere is it?"},
            {"role": "assistant", "content": "<|box_start|>(010,020),(300,400)<|box_end|>"}]  # data.grounding's zero_pad
    inputs = proc(messages=msgs, images=[img])
    out = model(**inputs)
    # positional path, same arrays: identical numbers
    batch = build_model_inputs([[{k: v[0] if k in ("input_ids", "labels") else v for k, v in inputs.items()}]],
                               model.config)
    pos_logits = model(*model_args(batch))[0].asnumpy()
    np.testing.assert_array_equal(out.logits.asnumpy(), pos_logits)
    # transformers: same inputs (from its processor), labels = ours (transformers' processor makes none)
    ref_in = _hf_inputs(hf_proc, msgs, [img], add_generation_prompt=False)
    np.testing.assert_array_equal(ref_in["input_ids"].numpy(), inputs["input_ids"])
    with torch.no_grad():
        ref = hf(**ref_in, labels=torch.tensor(inputs["labels"]))
    np.testing.assert_allclose(out.logits.asnumpy(), ref.logits.numpy(), atol=1e-4)
    assert abs(float(out.loss.asnumpy()) - float(ref.loss)) < 1e-4
    assert out["loss"] is out.loss and "logits" in out.keys()
    # another length: its loss against transformers too, on the loss graph compiled once (dynamic shapes)
    msgs2 = [msgs[0], {"role": "assistant", "content": "A small red square near the top left corner."}]
    inputs2 = proc(messages=msgs2, images=[img])
    assert inputs2["input_ids"].shape != inputs["input_ids"].shape
    with torch.no_grad():
        ref2 = hf(**_hf_inputs(hf_proc, msgs2, [img], add_generation_prompt=False),
                  labels=torch.tensor(inputs2["labels"]))
    assert abs(float(model(**inputs2).loss.asnumpy()) - float(ref2.loss)) < 1e-4
    assert hf_api._TOKEN_MEAN and all(len(cell.compile_cache) == 1 for cell in hf_api._TOKEN_MEAN.values())
    # Tensors in, and no labels -> no loss
    ms_inputs = proc(messages=msgs, images=[img], return_tensors="ms")
    ms_inputs.pop("labels")
    out2 = model(**ms_inputs)
    assert out2.loss is None
    np.testing.assert_array_equal(out2.logits.asnumpy(), pos_logits)


def test_left_padded_batch_matches_transformers(setup):
    _, hf, hf_proc, proc, model, img = setup
    convs = [[{"role": "user", "content": "<image>\nDescribe the picture in a few words."}],
             [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]]
    ref_in = _hf_inputs(hf_proc, convs, [img])
    mask = ref_in["attention_mask"].numpy()
    assert mask[1, 0] == 0  # the second row is left-padded
    out = model(**{k: v.numpy() for k, v in ref_in.items()})
    with torch.no_grad():
        ref = hf(**ref_in).logits.numpy()
    keep = mask.astype(bool)
    np.testing.assert_allclose(out.logits.asnumpy()[keep], ref[keep], atol=1e-4)
    assert np.all(out.logits.asnumpy()[~keep] == 0)
    # each row alone through the processor gives the same logits as its row of the batch (no labels: the
    # loss, which would compile a loss graph for this length, is not asked for)
    alone = proc(messages=convs[1])
    alone.pop("labels")
    single = model(**alone).logits.asnumpy()[0]
    np.testing.assert_allclose(out.logits.asnumpy()[1][keep[1]], single, atol=1e-5)
    # batched greedy generation from the left-padded batch: transformers' layout and tokens
    ids = model.generate(**{k: v.numpy() for k, v in ref_in.items()}, max_new_tokens=3, eos_token_id=IM_END,
                         use_cache=False)
    with torch.no_grad():
        ref_ids = hf.generate(**ref_in, max_new_tokens=3, do_sample=False, eos_token_id=IM_END,
                              pad_token_id=PAD).numpy()
    np.testing.assert_array_equal(ids, ref_ids)
    with pytest.raises(TypeError, match="output_hidden_states"):
        model(**proc(messages=convs[1]), output_hidden_states=True)


def test_generate_matches_transformers_generate(setup):
    _, hf, hf_proc, proc, model, img = setup
    msgs = [{"role": "user", "content": "<image>\nWhat is in the picture?"}]
    inputs = proc(messages=msgs, images=[img])
    # use_cache=False: one full forward per token through the already compiled graph (the KV-cache engine,
    # the default, is checked against transformers in test_infer_generate.py; it compiles three graphs)
    ids = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=IM_END, use_cache=False)
    with torch.no_grad():
        ref = hf.generate(**_hf_inputs(hf_proc, msgs, [img]), max_new_tokens=5, do_sample=False,
                          eos_token_id=IM_END, pad_token_id=PAD).numpy()
    assert ids.dtype == np.int64 and ids.shape == ref.shape
    np.testing.assert_array_equal(ids, ref)
    # the same as the generation module called directly (the layer adds nothing)
    from mindvl_ms.infer.generate import generate

    direct = generate(model, [{"input_ids": inputs["input_ids"][0], "pixel_values": inputs["pixel_values"],
                               "image_grid_thw": inputs["image_grid_thw"]}], 5, eos_token_ids=(IM_END,),
                      use_cache=False)
    assert ids[0, inputs["input_ids"].shape[1]:].tolist() == direct[0]
