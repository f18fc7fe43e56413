"""`mindvl generate` / `chat` / `export` error handling: missing checkpoint, unreadable image, prompt longer
than the context, all reported as one clear line (exit code 2) before any graph runs.
Run: pytest tests/infer/test_cli.py
"""
import builtins
import gc
import os

import pytest

import mindvl_ms.infer.generate as G
from mindvl_ms import cli
from mindvl_ms.cli import main
from mindvl_ms.config import MindVLConfig
from mindvl_ms.config.base import load, read_yaml
from mindvl_ms.ops.process import freeze_imported_objects
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def loaded():
    """(checkpoint, fp16) -> model, for this module's tests."""
    models = {}
    yield models
    models.clear()


@pytest.fixture(autouse=True)
def only_infer_commands(monkeypatch, loaded):
    """The real `mindvl` entry point with just this area's subcommands registered; the commands and the
    eval backend load a checkpoint once per module (one model: one set of compiled graphs)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["mindvl_ms.cli.infer"])
    real = G.load_model

    def load_once(ckpt, fp16=False):
        key = (os.path.abspath(ckpt), fp16)
        if key not in loaded:
            loaded[key] = real(ckpt, fp16)
        return loaded[key]
    monkeypatch.setattr(G, "load_model", load_once)
    yield


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """configs/model/tiny.yaml (real Qwen3 vocabulary) made narrower, with a 64-token context."""
    from mindvl_ms import MindVLForConditionalGeneration

    d = read_yaml(os.path.join(ROOT, "configs", "model", "tiny.yaml"))
    d["vision"].update(depth=1, fullatt_block_indexes=[0], hidden_size=32, intermediate_size=32, num_heads=2,
                       out_hidden_size=32)
    d["text"].update(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, mrope_section=[2, 3, 3], max_position_embeddings=64)
    cfg = load(MindVLConfig, d, "tiny.yaml")
    cfg.validate()
    path = str(tmp_path_factory.mktemp("ckpt") / "small")
    MindVLForConditionalGeneration(cfg).save_pretrained(path)
    return path


def test_missing_checkpoint_and_unreadable_image(tmp_path, capsys):
    assert main(["generate", "--ckpt", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["generate", "--ckpt", str(tmp_path), "--image", str(bad), "--prompt", "hi"]) == 2
    assert f"cannot read image {bad}" in capsys.readouterr().err
    assert main(["generate", "--ckpt", str(tmp_path), "--image", str(tmp_path / "nope.png"), "--prompt", "hi"]) == 2
    assert "image not found" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_prompt_longer_than_context(small_ckpt, capsys):
    assert main(["generate", "--ckpt", small_ckpt, "--prompt", "word " * 80, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 64 tokens" in err


def test_model_command_freezes_the_imported_objects_once(small_ckpt, capsys):
    """`mindvl generate` freezes the objects alive before it builds its model (MindSpore's gc.collect() before
    each graph compile then skips them), once per process: a second command in the same process freezes
    nothing more, so the first command's model stays collectable."""
    argv = ["generate", "--ckpt", small_ckpt, "--prompt", "word " * 80, "--max-new-tokens", "4"]
    gc.unfreeze()  # as in a fresh `mindvl` process (the test session froze its imports)
    try:
        assert main(argv) == 2
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert main(argv) == 2
        # nothing more frozen; the count may drop: a frozen object freed meanwhile (another thread's, such as
        # pytest-xdist's messages to the controller) leaves the permanent generation
        assert gc.get_freeze_count() <= frozen
    finally:
        freeze_imported_objects()  # the session's objects frozen again (a no-op when the commands froze them)
    assert "exceeds the model's context" in capsys.readouterr().err


def test_chat_reports_errors_and_keeps_going(small_ckpt, tmp_path, monkeypatch, capsys):
    lines = iter(["/image " + str(tmp_path / "missing.png"), "word " * 80, "/reset", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--ckpt", small_ckpt]) == 0
    captured = capsys.readouterr()
    assert "image not found" in captured.err
    assert "exceeds the model's context" in captured.err
    assert "(history cleared)" in captured.out


def test_eval_backend_and_text_generation(small_ckpt, tmp_path):
    """`mindvl eval`'s backend: encode_images features + prompt give the same answer as generate_text from
    the image file, and an image is encoded once however often it is asked about."""
    import numpy as np
    from PIL import Image

    from mindvl_ms.infer.generate import generate_text, load_eval_backend

    path = str(tmp_path / "img.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8)).save(path)
    backend = load_eval_backend(small_ckpt, max_new_tokens=4)
    msgs = [{"role": "user", "content": "<image>\nWhat is shown?"}]
    hw = [(56, 84)]
    feats = backend.encode_images([(path, *hw[0])])[0]
    assert feats.shape == (56 * 84 // 28 ** 2, 32)
    with_feats = backend.generate([{"messages": msgs, "images": [path], "image_hw": hw, "image_features": [feats]},
                                   {"messages": [{"role": "user", "content": "Hello"}], "images": []}])
    from_file = generate_text(backend.model, backend.processor, [{"messages": msgs, "images": [path],
                                                                  "image_hw": hw}], max_new_tokens=4)
    assert len(with_feats) == 2 and all(isinstance(t, str) for t in with_feats)
    assert from_file[0] == with_feats[0]  # greedy from the file == greedy from the cached features
    # token level, sampled (seeded) so that the whole distribution must agree, not just the argmax
    from mindvl_ms.infer.generate import encode_chat, generate

    enc = encode_chat(backend.processor, msgs, [path], hw)
    feat_sample = {"input_ids": enc["input_ids"], "image_features": [feats], "image_grid_thw": enc["image_grid_thw"]}
    a = generate(backend.model, [enc], 6, do_sample=True, temperature=2.0, seed=1)
    assert a == generate(backend.model, [feat_sample], 6, do_sample=True, temperature=2.0, seed=1)
    assert backend.engine.stats["images_encoded"] == 1


def test_eval_backend_encodes_a_batchs_images_together(small_ckpt, tmp_path, monkeypatch):
    """encode_images: images of different sizes in one vision call give each image's features as encoding
    it alone does; VISION_CALL_PATCHES splits the calls."""
    import numpy as np
    from PIL import Image

    from mindvl_ms.infer import generate as G

    rng = np.random.default_rng(1)
    reqs = []
    for i, (h, w) in enumerate([(56, 84), (28, 56), (84, 84)]):
        path = str(tmp_path / f"img{i}.png")
        Image.fromarray(rng.integers(0, 256, (h + 9, w + 5, 3), dtype=np.uint8)).save(path)
        reqs.append((path, h, w))
    backend = G.load_eval_backend(small_ckpt, max_new_tokens=4)
    stats = backend.engine.stats
    alone = []
    for r in reqs:
        alone += backend.encode_images([r])
    calls = stats["vision_calls"]
    backend.engine.image_cache.clear()
    together = backend.encode_images(reqs)
    assert stats["vision_calls"] == calls + 1
    assert [f.shape for f in together] == [(6, 32), (2, 32), (9, 32)]
    for a, b in zip(alone, together):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    backend.engine.image_cache.clear()
    monkeypatch.setattr(G, "VISION_CALL_PATCHES", 24 + 8)  # patches 24, 8, 36: [24, 8] then [36] alone
    backend.encode_images(reqs)
    assert stats["vision_calls"] == calls + 3
    backend.engine.image_cache.clear()
    monkeypatch.setattr(G, "VISION_CALL_PATCHES", 16384)
    monkeypatch.setattr(backend.engine, "max_cached_images", 2)  # three images in one call, a cache of two
    again = backend.encode_images(reqs)
    assert stats["vision_calls"] == calls + 4 and len(backend.engine.image_cache) == 2
    for a, b in zip(alone, again):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_generate_with_a_video(small_ckpt, tmp_path, capsys):
    """`mindvl generate --video` on a generated clip, with the checkpoint's own video settings (a small
    frame budget written into its preprocessor_config.json, as a training run writes it)."""
    import json

    from tests.support.video import write_video

    pre = os.path.join(small_ckpt, "preprocessor_config.json")
    d = json.load(open(pre)) if os.path.isfile(pre) else {}
    d["video"] = {"fps": 2.0, "fps_range": [], "min_frames": 2, "max_frames": 4, "video_min_pixels": 784,
                  "video_max_pixels": 4 * 784, "video_total_pixels": 8 * 784}
    with open(pre, "w") as f:
        json.dump(d, f)
    clip = tmp_path / "clip.mkv"
    write_video(clip, frames=12, fps=6, width=56, height=56)
    assert main(["generate", "--ckpt", small_ckpt, "--video", str(clip), "--prompt", "What moves?",
                 "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert out.err == "" or "error" not in out.err
    assert main(["generate", "--ckpt", small_ckpt, "--video", str(tmp_path / "nope.mp4"), "--prompt", "x"]) == 2
    assert "video not found" in capsys.readouterr().err
