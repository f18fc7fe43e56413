"""`mindvl data validate` / `mindvl data pack`: every planted defect is reported on its line, --drop-bad
writes exactly the clean lines, exit codes. Run: pytest -q tests/data/test_validate.py"""
import json
import os

import numpy as np
from PIL import Image

from tests.support.data import make_jsonl
from mindvl_ms.cli import main
from mindvl_ms.data.validate import validate_file


def _planted(tmp_path):
    d = tmp_path / "img"
    d.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(d / "ok.png")
    Image.new("RGB", (64, 64), (7, 7, 7)).save(d / "blank.png")
    Image.fromarray(rng.integers(0, 256, (2, 50, 3), dtype=np.uint8)).save(d / "thin.png")
    Image.fromarray(rng.integers(0, 256, (5, 900, 3), dtype=np.uint8)).save(d / "wide.png")
    (d / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    good = lambda img, ans="fine", **kw: json.dumps({"images": [f"img/{img}"], "messages": [  # noqa: E731
        {"role": "user", "content": "<image>Describe."}, {"role": "assistant", "content": ans}], **kw})
    lines = [
        good("ok.png"),                                                                   # 1 ok
        good("missing.png"),                                                              # 2 missing
        good("corrupt.jpg"),                                                              # 3 corrupt
        good("blank.png"),                                                                # 4 blank
        good("thin.png"),                                                                 # 5 min resolution
        good("wide.png"),                                                                 # 6 aspect (180)
        json.dumps({"images": ["img/ok.png"], "messages": [{"role": "user", "content": "no placeholder"},
                                                             {"role": "assistant", "content": "x"}]}),  # 7
        good("ok.png", "<|box_start|>(10,20),(300,1200)<|box_end|>"),                    # 8 grounding range
        good("ok.png", "<|box_start|>(10,20),(300,400)"),                               # 9 unbalanced
        good("ok.png", "<|object_ref_start|>a<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"),  # 10 ok
        "",                                                                               # 11 blank line
        "[1, 2",                                                                          # 12 invalid json
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),                   # 13 no assistant
        good("ok.png", image_sizes=[[80, 64]]),                                           # 14 ok, sizes right
        good("ok.png", image_sizes=[[64, 80]]),                                           # 15 size mismatch
        json.dumps({"messages": [{"role": "user", "content": "<|image_pad|>"},
                                 {"role": "assistant", "content": "x"}]}),                # 16 raw token
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


EXPECTED = {2: {"missing image"}, 3: {"corrupt image"}, 4: {"blank image"}, 5: {"below minimum resolution"},
            6: {"extreme aspect ratio"}, 7: {"image count mismatch"}, 8: {"grounding"}, 9: {"grounding"},
            11: {"blank line"}, 12: {"invalid json"}, 13: {"schema"}, 15: {"image size mismatch"},
            16: {"raw vision token"}}


def test_every_defect_is_reported_on_its_line(tmp_path):
    from mindvl_ms.config.data import ImageConfig

    rep = validate_file(_planted(tmp_path), ImageConfig(max_aspect_ratio=100, min_side=4), workers=1, progress=False)
    got = {}
    for e in rep["errors"]:
        got.setdefault(e["line"], set()).add(e["reason"])
    assert got == EXPECTED
    assert rep["num_lines"] == 16 and rep["num_bad"] == len(EXPECTED) and rep["num_ok"] == 3
    assert rep["counts"]["grounding"] == 2 and sum(rep["counts"].values()) == len(rep["errors"])


def test_cli_validate_exit_codes_and_drop_bad(tmp_path, capsys):
    src = _planted(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  image:\n    max_aspect_ratio: 100\n    min_side: 4\n")
    assert main(["data", "validate", src, "--config", str(cfg), "--quiet", "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert f"{src}:3: corrupt image" in out and "16 lines, 3 ok, 13 with errors" in out
    os.makedirs(tmp_path / "clean")
    clean = str(tmp_path / "clean" / "c.jsonl")
    rep = str(tmp_path / "r.json")
    assert main(["data", "validate", src, "--config", str(cfg), "--quiet", "--drop-bad", clean,
                 "--report", rep]) == 0
    with open(rep) as f:
        assert json.load(f)["dropped_lines"] == sorted(EXPECTED)
    # the clean file (another directory: image paths rebased) validates without errors
    assert main(["data", "validate", clean, "--config", str(cfg), "--quiet"]) == 0
    with open(clean) as f:
        assert len(f.readlines()) == 3


def test_cli_pack_and_bad_flag(tmp_path, capsys):
    src = make_jsonl(str(tmp_path / "d.jsonl"), 24)
    assert main(["data", "pack", src, str(tmp_path / "out"), "--seq-length", "400", "--max-image-tokens", "100",
                 "--dp-size", "2", "--workers", "1", "--quiet"]) == 0
    with open(tmp_path / "out" / "manifest.json") as f:
        man = json.load(f)
    assert man["seq_length"] == 400 and man["dp_size"] == 2
    assert sorted(ln for p in man["packs"] for ln in p["lines"]) + [d["line"] for d in man["dropped"]] and \
        sorted([ln for p in man["packs"] for ln in p["lines"]] + [d["line"] for d in man["dropped"]]) == \
        list(range(1, 25))
    assert main(["data", "pack", src, str(tmp_path / "o2"), "--seq-length", "400", "--max-image-tokens", "900",
                 "--quiet"]) == 2
    assert "max_image_tokens 900 must be in 1..seq_length=400" in capsys.readouterr().err
