"""HF <-> native conversion: bit-exact round trip (single file and sharded), CLI, and `mindvl init`."""
import json
import os

import numpy as np
import pytest
import torch

from tests.support import hf_tiny as hf_tiny
from mindvl_ms.checkpoint.hf import read_config_json
from mindvl_ms.checkpoint.io import read_tensors, to_bf16_bits
from mindvl_ms.cli import main


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, hf = hf_tiny.tiny_qwen2_5_vl(tmp_path_factory.mktemp("hf"))
    return path, hf


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].data.tobytes() == b[k].data.tobytes(), k


def test_hf2ms_ms2hf_round_trip_bit_exact(hf_dir, tmp_path):
    src, hf = hf_dir
    assert main(["convert", "hf2ms", src, str(tmp_path / "ms")]) == 0
    native = read_tensors(str(tmp_path / "ms"))
    assert native["visual.patch_embed.proj.weight"].shape == (32, 3 * 2 * 14 * 14)  # MatMul layout
    assert read_config_json(str(tmp_path / "ms"))["format"] == "mindvl-native"
    assert main(["convert", "ms2hf", str(tmp_path / "ms"), str(tmp_path / "hf"), "--max-shard-mb", "0.2"]) == 0
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")  # sharded
    _same(read_tensors(src), read_tensors(str(tmp_path / "hf")))
    # the written HF directory loads in transformers and gives the same logits
    from transformers import Qwen2_5_VLForConditionalGeneration

    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)
    # sharded HF -> native -> HF again
    assert main(["convert", "hf2ms", str(tmp_path / "hf"), str(tmp_path / "ms2")]) == 0
    _same(read_tensors(str(tmp_path / "ms")), read_tensors(str(tmp_path / "ms2")))


def test_bf16_tensors_survive_round_trip(hf_dir, tmp_path):
    from mindvl_ms.checkpoint.io import RawTensor, write_tensors

    src, _ = hf_dir
    t = read_tensors(src)
    bf = {k: RawTensor(to_bf16_bits(v.float32()), "BF16") for k, v in t.items()}
    os.makedirs(tmp_path / "bf")
    write_tensors(str(tmp_path / "bf"), bf)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(tmp_path / "bf" / "config.json", "w") as f:
        json.dump(cfg, f)
    assert main(["convert", "hf2ms", str(tmp_path / "bf"), str(tmp_path / "bfms")]) == 0
    assert main(["convert", "ms2hf", str(tmp_path / "bfms"), str(tmp_path / "bfhf")]) == 0
    _same(bf, read_tensors(str(tmp_path / "bfhf")))
    # bf16 widening is exact: torch agrees
    k = "model.embed_tokens.weight"
    ref = torch.tensor(t[k].float32()).to(torch.bfloat16).float().numpy()
    assert np.array_equal(bf[k].float32(), ref)


def test_init_takes_vit_from_qwen2_5_vl_and_llm_from_qwen3(hf_dir, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    src, _ = hf_dir
    torch.manual_seed(1)
    q3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      max_position_embeddings=128, tie_word_embeddings=True))
    q3.save_pretrained(tmp_path / "q3")
    assert main(["init", "--vision-from", src, "--llm-from", str(tmp_path / "q3"), "--out",
                 str(tmp_path / "init")]) == 0
    out = read_tensors(str(tmp_path / "init"))
    vit, llm = read_tensors(src), read_tensors(str(tmp_path / "q3"))
    assert np.array_equal(out["visual.blocks.0.attn.qkv.weight"].data, vit["visual.blocks.0.attn.qkv.weight"].data)
    assert np.array_equal(out["visual.patch_embed.proj.weight"].data,
                          vit["visual.patch_embed.proj.weight"].data.reshape(32, -1))
    assert np.array_equal(out["model.layers.1.self_attn.q_norm.weight"].data,
                          llm["model.layers.1.self_attn.q_norm.weight"].data)
    assert "lm_head.weight" not in out  # tied, as the Qwen3 source
    merger = out["visual.merger.mlp.2.weight"]
    assert merger.shape == (48, 32 * 4)  # projector sized for the new LLM, randomly initialised
    assert 0.005 < merger.data.std() < 0.05
    cfg = read_config_json(str(tmp_path / "init"))["config"]
    assert cfg["text"]["model_type"] == "qwen3" and cfg["vision"]["out_hidden_size"] == 48


def test_convert_missing_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["convert", "hf2ms", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert f"checkpoint directory not found: {tmp_path / 'nope'}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["convert", "hf2ms", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'empty'}: no config.json (expected a checkpoint directory)" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_text_only_llm_convert_round_trip_and_logits(tmp_path, kind):
    """`mindvl convert hf2ms` on a plain LLM directory: the native model's logits equal transformers', and
    `ms2hf` gives the original tensors back byte for byte."""
    import mindspore as ms
    from mindspore import Tensor

    from mindvl_ms.checkpoint.pretrained import load_text_model

    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          max_position_embeddings=128)).eval()
        src = str(tmp_path / "hf")
        hf.save_pretrained(src)
    else:
        from tests.models.test_moe_parity import hf_tiny_deepseek

        src, hf = hf_tiny_deepseek(tmp_path / "hf", num_hidden_layers=2)  # a dense layer, then an MoE one
    assert main(["convert", "hf2ms", src, str(tmp_path / "ms")]) == 0
    assert read_config_json(str(tmp_path / "ms"))["kind"] == "text"
    assert main(["convert", "ms2hf", str(tmp_path / "ms"), str(tmp_path / "back")]) == 0
    _same(read_tensors(src), read_tensors(str(tmp_path / "back")))
    model = load_text_model(str(tmp_path / "ms"))
    ids = np.random.default_rng(0).integers(0, 256, (1, 9))
    pos = np.broadcast_to(np.arange(9), (3, 1, 9)).astype(np.int32)
    logits = model(Tensor(ids.astype(np.int32)), Tensor(pos), Tensor(np.ones((1, 9), np.int32)))[0].asnumpy()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(logits - ref).max() <= 1e-4


def test_unsupported_rope_scaling_is_rejected(tmp_path):
    from mindvl_ms.config import ConfigError
    from mindvl_ms.config.model import text_from_hf

    d = {"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
         "rope_scaling": {"type": "yarn", "factor": 40}}
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' is not supported"):
        text_from_hf(d)
