"""Processor exactness against transformers' Qwen2VLImageProcessor (slow path) and the tokenizer's
own chat encoding; labels on assistant tokens only. Run: pytest -q tests/data/test_processor.py"""
import os

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from mindvl_ms.config.data import ImageConfig
from mindvl_ms.data.image import image_tokens, patchify, process_images, smart_resize
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.tokens import IGNORE_INDEX
from mindvl_ms.data.schema import SampleError, parse_sample
from mindvl_ms.data.tokenizer import TextTokenizer, default_tokenizer_dir, load_tokenizer


@pytest.fixture(scope="module")
def proc():
    return MindVLProcessor.from_pretrained()


def _real_images():
    rgb = lambda a: Image.fromarray(a if a.ndim == 3 else np.stack([a] * 3, -1))  # noqa: E731
    return {"astronaut": rgb(skdata.astronaut()), "coffee": rgb(skdata.coffee()), "chelsea": rgb(skdata.chelsea()),
            "text_page": Image.fromarray(skdata.text()),  # grayscale "L": exercises RGB conversion
            "rocket": rgb(skdata.rocket())}


@pytest.mark.parametrize("size", [(1, 1), (3, 500), (28, 28), (56, 56), (27, 29), (1000, 5), (5, 999),
                                  (2240, 2240), (4000, 3000), (560, 840), (29, 5700), (3, 600)])
@pytest.mark.parametrize("limits", [(56 * 56, 28 * 28 * 1280), (256 * 28 * 28, 512 * 28 * 28)])
def test_smart_resize_matches_hf(size, limits):
    h, w = size
    assert smart_resize(h, w, 28, *limits) == hf_smart_resize(h, w, 28, *limits)


def test_smart_resize_aspect_limit():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201)
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_smart_resize(1, 201)


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea", "text_page", "rocket"])
def test_patches_match_hf_on_real_images(name):
    img = _real_images()[name]
    hf = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=160 * 28 * 28)
    ref = hf(images=[img], return_tensors="np")
    cfg = ImageConfig(min_pixels=56 * 56, max_pixels=160 * 28 * 28)
    pv, grid = patchify(img, cfg)
    np.testing.assert_array_equal(grid[None], ref["image_grid_thw"])
    assert pv.dtype == np.float32 and pv.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(pv, ref["pixel_values"], rtol=0, atol=1e-6)
    assert image_tokens(img.width, img.height, cfg) == int(np.prod(grid)) // 4


@pytest.mark.parametrize("wh", [(5, 7), (28, 28), (56, 84), (700, 14), (100, 3), (1200, 900), (4, 300)])
def test_patches_match_hf_on_edge_sizes(wh):
    rng = np.random.default_rng(sum(wh))
    img = Image.fromarray(rng.integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8))
    hf = Qwen2VLImageProcessor(min_pixels=8 * 28 * 28, max_pixels=64 * 28 * 28)
    ref = hf(images=[img, img.rotate(90, expand=True)], return_tensors="np", input_data_format="channels_last")
    pv, grid = process_images([img, img.rotate(90, expand=True)],
                              ImageConfig(min_pixels=8 * 28 * 28, max_pixels=64 * 28 * 28))
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    np.testing.assert_allclose(pv, ref["pixel_values"], rtol=0, atol=1e-6)


def test_chat_template_and_labels(proc):
    tok = proc.tokenizer
    img = Image.fromarray(skdata.astronaut()).resize((100, 80))
    msgs = [{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": "An astronaut."},
            {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes, 100%."}]
    out = proc(messages=msgs, images=[img])
    ids, labels = out["input_ids"][0], out["labels"][0]
    n_img = int(np.prod(out["image_grid_thw"][0])) // 4
    # independent reference: the full template string with N pads, encoded in one go
    ref_text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                + "<|image_pad|>" * n_img + "<|vision_end|>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
                "An astronaut.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\nYes, 100%."
                "<|im_end|>\n")
    assert ids.tolist() == tok.encode(ref_text)
    assert (ids == 151655).sum() == n_img and ids.dtype == np.int64
    sup = ids[labels != IGNORE_INDEX]
    expect = tok.encode("An astronaut.<|im_end|>") + tok.encode("Yes, 100%.<|im_end|>")
    assert sup.tolist() == expect
    np.testing.assert_array_equal(labels[labels != IGNORE_INDEX], sup)
    assert out["pixel_values"].shape == (n_img * 4, 1176)


def test_generation_prompt_and_text_only(proc):
    out = proc(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = proc.tokenizer.decode(out["input_ids"][0])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (out["labels"] == IGNORE_INDEX).all() and "pixel_values" not in out


def test_hf_content_parts_and_count_tokens(proc, tmp_path):
    Image.fromarray(skdata.coffee()).save(tmp_path / "c.png")
    Image.fromarray(skdata.chelsea()).save(tmp_path / "d.jpg")
    obj = {"images": ["c.png", "d.jpg"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "<|box_start|>(10,20),(300,400)<|box_end|>"}]}
    s = parse_sample(obj, str(tmp_path / "x.jsonl"), 3)
    out = proc.process_sample(s)
    assert out["line"] == 3 and out["image_grid_thw"].shape == (2, 3)
    counts = [image_tokens(*Image.open(p).size, proc.image_config) for p in s.images]
    assert proc.count_tokens(s.messages, counts) == len(out["input_ids"])
    assert (out["input_ids"] == 151655).sum() == sum(counts)


def test_image_count_mismatch_is_an_error(proc, tmp_path):
    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    s = parse_sample({"images": ["a.png"], "messages": [{"role": "user", "content": "no placeholder"},
                                                          {"role": "assistant", "content": "x"}]},
                     str(tmp_path / "f.jsonl"), 7)
    with pytest.raises(SampleError, match=r"f.jsonl:7: image count mismatch"):
        proc.process_sample(s)


def test_schema_errors_name_the_field(tmp_path):
    with pytest.raises(SampleError, match=r"f.jsonl:2: schema: .*role"):
        parse_sample({"messages": [{"role": "bot", "content": "x"}]}, str(tmp_path / "f.jsonl"), 2)
    with pytest.raises(SampleError, match="image_sizes"):
        parse_sample({"images": ["a.png"], "image_sizes": [[0, 4]],
                      "messages": [{"role": "assistant", "content": "x"}]}, "f.jsonl", 1)


def _vocab_merges_dir(tmp_path):
    """A copy of the Qwen3 tokenizer as vocab.json + merges.txt + tokenizer_config.json."""
    d = tmp_path / "vm"
    d.mkdir()
    src = default_tokenizer_dir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (d / name).write_bytes(open(os.path.join(src, name), "rb").read())
    return d


def test_tokenizer_formats_agree(tmp_path):
    full = load_tokenizer()
    vm = load_tokenizer(str(_vocab_merges_dir(tmp_path)))
    text = "<|im_start|>user\nHello wörld 12345, café!\n\n  x<|image_pad|><|im_end|>"
    assert vm.encode(text) == full.encode(text) and vm.vocab_size == full.vocab_size == 151669


def test_a_tokenizer_loads_once_per_process_until_its_files_change(tmp_path):
    d = _vocab_merges_dir(tmp_path)
    first = load_tokenizer(str(d))
    assert load_tokenizer(str(d)) is first  # the same files: the built tokenizer is reused
    assert load_tokenizer(str(d / "")) is first and load_tokenizer() is not first  # the path, resolved, is the key
    # merges.txt without its last merge: other files, so a new tokenizer that encodes by them
    merges = (d / "merges.txt").read_text(encoding="utf-8").rstrip("\n").split("\n")
    last = merges[-1].split(" ")
    (d / "merges.txt").write_text("\n".join(merges[:-1]) + "\n", encoding="utf-8")
    second = load_tokenizer(str(d))
    assert second is not first and load_tokenizer(str(d)) is second
    word = first.tok.decode([first.token_to_id(last[0] + last[1])])  # the text the dropped merge made one token
    assert len(first.encode(word)) == 1 and len(second.encode(word)) == 2


def test_vocab_size_is_counted_once_per_tokenizer(tmp_path):
    tok = load_tokenizer(str(_vocab_merges_dir(tmp_path)))
    calls = []

    class Counting:  # the wrapped tokenizers.Tokenizer, its vocabulary counts recorded
        def get_vocab_size(self, with_added_tokens=True):
            calls.append(with_added_tokens)
            return real.get_vocab_size(with_added_tokens=with_added_tokens)

    real = tok.tok
    fresh = TextTokenizer(Counting(), tok.source, tok.eos_token)
    assert fresh.vocab_size == fresh.vocab_size == real.get_vocab_size(with_added_tokens=True)
    assert calls == [True]


def test_sentencepiece_model_loads(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i % 7}" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=60,
                                   model_type="unigram", minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    tok = load_tokenizer(str(tmp_path / "m.model"))
    text = "the lazy fox jumps"
    assert tok.encode(text) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
