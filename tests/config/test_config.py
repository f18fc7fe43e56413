"""Config loading: shipped YAMLs load, unknown/mistyped keys name file + key + closest key, bad shapes fail."""
import os

import numpy as np

import pytest

from mindvl_ms.config import ConfigError, MindVLConfig, load, load_model_config, read_yaml
from mindvl_ms.config.train import load_run_config
from tests.support.paths import ROOT

MODEL_DIR = os.path.join(ROOT, "configs", "model")


def test_shipped_model_configs_load():
    tiny = load_model_config(os.path.join(MODEL_DIR, "tiny.yaml"))
    assert tiny.text.head_dim_ == 32 and sum(tiny.text.mrope_section) == 16
    b8 = load_model_config(os.path.join(MODEL_DIR, "mindvl-8b.yaml"))
    assert (b8.vision.depth, b8.vision.hidden_size, b8.text.num_hidden_layers) == (32, 1280, 36)
    pangu = load_model_config(os.path.join(MODEL_DIR, "openpangu-vl-7b.yaml"))
    v = pangu.vision
    assert (v.depth, v.head_dim, v.num_heads, v.intermediate_size, v.hidden_act, v.mlp_type) == \
        (26, 96, 16, 4608, "gelu", "plain")
    assert [i + 1 for i in v.fullatt_block_indexes] == [6, 13, 20, 26]
    assert pangu.text.hidden_size == 4096  # included from mindvl-8b.yaml


def _write(tmp_path, text):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    return str(p)


def test_unknown_key_names_file_key_and_closest(tmp_path):
    p = _write(tmp_path, "vision:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_model_config(p)
    msg = str(e.value)
    assert p in msg and "vision.hiden_size" in msg and "did you mean 'hidden_size'" in msg


def test_wrong_type_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="text.num_hidden_layers.*expected an integer"):
        load_model_config(_write(tmp_path, "text:\n  num_hidden_layers: two\n"))


@pytest.mark.parametrize("text, message", [
    ("text:\n  num_attention_heads: 5\n  head_dim: null\n  hidden_size: 64\n", "not divisible by num_attention_heads"),
    ("text:\n  num_key_value_heads: 3\n", "not divisible by num_key_value_heads"),
    ("text:\n  mrope_section: [16, 24, 23]\n", "sums to 63, expected rotary dim / 2 = 64"),
    ("vision:\n  num_heads: 7\n", "not divisible by num_heads"),
    ("vision:\n  window_size: 100\n", "multiple of patch_size"),
    ("vision:\n  fullatt_block_indexes: [40]\n", "outside"),
    ("vision:\n  out_hidden_size: 100\n", "must equal text.hidden_size"),
])
def test_impossible_shapes_rejected_at_load(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_model_config(_write(tmp_path, text))


def test_include_is_relative_and_overridable(tmp_path):
    (tmp_path / "base.yaml").write_text("text:\n  num_hidden_layers: 3\n  hidden_size: 4096\n")
    p = _write(tmp_path, "_include_: base.yaml\ntext:\n  num_hidden_layers: 5\n")
    data = read_yaml(p)
    assert data["text"] == {"num_hidden_layers": 5, "hidden_size": 4096}
    assert load(MindVLConfig, data, p).text.num_hidden_layers == 5


def test_model_reference_stays_relative_to_the_file_that_wrote_it(tmp_path):
    """A run YAML elsewhere `_include_`s configs/demo/train.yaml, whose `model: {_include_: ../model/tiny.yaml}`
    must resolve next to train.yaml, not next to the including file."""
    from mindvl_ms.config.train import load_run_config

    demo = os.path.join(os.path.dirname(MODEL_DIR), "demo", "train.yaml")
    p = _write(tmp_path, f"_include_: {demo}\nmodel:\n  text: {{num_hidden_layers: 3}}\n")
    cfg = load_run_config(p)
    tiny = load_model_config(os.path.join(MODEL_DIR, "tiny.yaml"))
    assert cfg.model.text.num_hidden_layers == 3                      # this file's override
    assert cfg.model.text.mrope_layout == "interleaved"               # train.yaml's model section
    assert cfg.model.vision.hidden_size == tiny.vision.hidden_size    # tiny.yaml, found relative to train.yaml
    assert cfg.model.text.vocab_size == tiny.text.vocab_size


def test_model_files_in_any_section_are_resolved_and_copied(tmp_path):
    """`model: FILE.yaml` in any section (not only a top-level or a named one) resolves against the file that
    wrote it, and init-config's reference list holds it with every `_include_`."""
    from mindvl_ms.config.base import file_references

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "inner.yaml").write_text("anything:\n  deeper: {model: ../m/tiny.yaml, other: x.yaml}\n"
                                               "sec: {_include_: b.yaml}\n")
    p = _write(tmp_path, "_include_: a/inner.yaml\n")
    data = read_yaml(p)
    assert data["anything"]["deeper"] == {"model": str(tmp_path / "a" / "../m/tiny.yaml"), "other": "x.yaml"}
    assert data["sec"]["_include_"] == [str(tmp_path / "a" / "b.yaml")]
    raw = {"_include_": ["x.yaml"], "model": {"_include_": "../model/tiny.yaml"},
           "recipe": {"model": "../model/tiny-moe.yaml", "steps": {"model": "not-a-file"}}}
    assert file_references(raw) == ["x.yaml", "../model/tiny.yaml", "../model/tiny-moe.yaml"]


def test_openpangu_shapes_from_the_report_and_public_config():
    """openPangu-ViT has ~615M parameters (report 2.2); the LLM is openPangu-Embedded-7B's published shape;
    3D-IM-RoPE gives space about six times the bands of time."""
    from mindspore.nn.utils import no_init_parameters

    from mindvl_ms.models.vision import VisionTransformer

    pangu = load_model_config(os.path.join(MODEL_DIR, "openpangu-vl-7b.yaml"))
    with no_init_parameters():
        vit = VisionTransformer(pangu.vision)
    blocks = sum(int(np.prod(p.shape)) for n, p in vit.parameters_and_names() if ".blocks." in f".{n}")
    assert 605e6 < blocks < 625e6, blocks
    t = pangu.text
    assert (t.num_hidden_layers, t.hidden_size, t.intermediate_size, t.num_attention_heads,
            t.num_key_value_heads, t.vocab_size) == (34, 4096, 12800, 32, 8, 153376)
    sec_t, sec_h, sec_w = t.mrope_section
    assert t.mrope_layout == "spread" and t.mrope_accumulate and 5.5 <= (sec_h + sec_w) / sec_t <= 6.5


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "configs", "stage"))))
def test_every_shipped_stage_reads_its_data_at_its_own_length(name):
    """A stage's data config carries the stage's seq_length, so its budgets (max_image_tokens) are checked
    against the stage's rows, not the run-level default (openPangu-VL's annealing and SFT stages set 16,384
    visual tokens at 16,384-token rows)."""
    cfg = load_run_config(os.path.join(ROOT, "configs", "stage", name))
    for stage in cfg.stages:
        data = cfg.stage_data(stage)
        assert (data.seq_length, data.micro_batch_size) == (stage.seq_length, stage.micro_batch_size)
        assert data.visual_budget() <= stage.seq_length
