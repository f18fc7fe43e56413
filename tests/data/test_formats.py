"""LLaVA, ShareGPT and parquet inputs: `mindvl data convert` writes this project's JSONL with image sizes,
names every record it skips (file, line / element / row, reason) with counts that add up, gives the same
output twice, tells the formats apart, and a training source with `format:` loads the same samples as the
converted file. Run: pytest -q tests/data/test_formats.py"""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.data import write_images
from mindvl_ms.cli import main
from mindvl_ms.config.data import DataConfig, DataSource
from mindvl_ms.config.base import ConfigError, load
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.data.formats import convert_file, detect_format, loader_image_dir
from mindvl_ms.data.skiplog import data_fingerprint, fingerprint_diff
from mindvl_ms.data.validate import validate_file

SEQ = 600


def _turn(who, text):
    return {"from": who, "value": text}


def _llava_records():
    """Single image, multi-image, a system turn with several turns, a missing image, text only."""
    return [
        {"id": "a1", "image": "img/astro.png",
         "conversations": [_turn("human", "<image>\nWhat is this?"), _turn("gpt", "An astronaut.")]},
        {"id": "a2", "image": ["img/coffee.jpg", "img/cat.png"],
         "conversations": [_turn("human", "<image>\n<image>\nCompare the two."), _turn("gpt", "A cup, then a cat.")]},
        {"id": "a3", "image": "img/page.png",
         "conversations": [_turn("system", "Answer briefly."), _turn("human", "<image>\nRead it."),
                           _turn("gpt", "Some text."), _turn("human", "Again?"), _turn("gpt", "Same text.")]},
        {"id": "a4", "image": "img/missing.jpg",
         "conversations": [_turn("human", "<image>\nAnd this?"), _turn("gpt", "Nothing.")]},
        {"id": 5, "conversations": [_turn("human", "Say hi."), _turn("gpt", "hi")]},
    ]


@pytest.fixture()
def llava(tmp_path):
    write_images(str(tmp_path / "img"))
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(_llava_records(), indent=1))
    return str(path)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(t) for t in f]


def _element_line(path, k):
    """The line element k of a JSON array written with indent=1 starts on."""
    starts = [n for n, t in enumerate(open(path).read().split("\n"), 1) if t == " {"]
    return starts[k]


def test_llava_json_array(llava, tmp_path):
    out = str(tmp_path / "out" / "train.jsonl")
    rep = convert_file(llava, out, "llava", progress=False)
    got = _lines(out)
    assert rep["num_records"] == 5 and rep["num_converted"] == 4 == len(got)
    assert rep["num_converted"] + len(rep["skipped"]) == rep["num_records"]
    assert rep["skipped_counts"] == {"missing image": 1}
    (s,) = rep["skipped"]
    assert (s["file"], s["record"], s["reason"]) == (llava, 4, "missing image")
    assert s["where"] == f"element 3 (line {_element_line(llava, 3)})" and "img/missing.jpg" in s["detail"]
    assert got[0] == {"id": "a1", "images": ["../img/astro.png"], "image_sizes": [[120, 90]],
                      "messages": [{"role": "user", "content": "<image>\nWhat is this?"},
                                   {"role": "assistant", "content": "An astronaut."}]}
    assert got[1]["images"] == ["../img/coffee.jpg", "../img/cat.png"]
    assert got[1]["image_sizes"] == [[200, 150], [60, 200]]
    assert [m["role"] for m in got[2]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert got[2]["messages"][0]["content"] == "Answer briefly."
    assert got[3] == {"id": "5", "messages": [{"role": "user", "content": "Say hi."},
                                              {"role": "assistant", "content": "hi"}]}
    assert validate_file(out, workers=1, progress=False)["num_bad"] == 0


def test_llava_jsonl_with_image_root(tmp_path):
    write_images(str(tmp_path / "photos"))
    src = tmp_path / "data" / "llava.jsonl"
    src.parent.mkdir()
    src.write_text("\n".join(json.dumps({"id": f"r{i}", "image": name, "conversations": [
        _turn("human", "<image>Describe."), _turn("gpt", "ok")]}) for i, name in enumerate(["rocket.jpg", "nope.png"]))
                   + "\n{broken\n")
    out = str(tmp_path / "conv.jsonl")
    rep = convert_file(str(src), out, "llava", image_root=str(tmp_path / "photos"), progress=False)
    assert _lines(out) == [{"id": "r0", "images": ["photos/rocket.jpg"], "image_sizes": [[90, 90]],
                            "messages": [{"role": "user", "content": "<image>Describe."},
                                         {"role": "assistant", "content": "ok"}]}]
    assert [(s["where"], s["reason"]) for s in rep["skipped"]] == [("line 2", "missing image"),
                                                                   ("line 3", "invalid json")]


def test_sharegpt_llamafactory(tmp_path):
    write_images(str(tmp_path / "img"))
    rows = [
        {"messages": [{"role": "user", "content": "<image><image>Which is larger?"},
                      {"role": "assistant", "content": "The first."}],
         "images": ["img/coffee.jpg", "img/rocket.jpg"], "system": "You look closely."},
        {"conversations": [_turn("human", "<image>What?"), _turn("gpt", "A cat."), _turn("human", "Sure?"),
                           _turn("gpt", "Yes.")], "images": ["img/cat.png"], "tools": ""},
        {"conversations": [_turn("human", "<image>Where?"), _turn("gpt", "Gone.")], "images": ["img/none.png"]},
        {"messages": [{"role": "system", "content": "A"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}], "system": "B"},
        {"conversations": [_turn("human", "call"), _turn("function_call", "{}"), _turn("gpt", "done")]},
        {"conversations": [_turn("human", "<image>two?"), _turn("gpt", "one")], "images": ["img/cat.png"] * 2},
    ]
    src = tmp_path / "sharegpt.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert detect_format(str(src)) == "sharegpt"
    out = str(tmp_path / "sharegpt_out.jsonl")
    rep = convert_file(str(src), out, "auto", progress=False)
    got = _lines(out)
    assert rep["format"] == "sharegpt" and len(got) == 2
    assert got[0]["messages"][0] == {"role": "system", "content": "You look closely."}
    assert got[0]["images"] == ["img/coffee.jpg", "img/rocket.jpg"] and got[0]["image_sizes"] == [[200, 150], [90, 90]]
    assert [m["role"] for m in got[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert got[1]["meta"] == {"tools": ""}
    assert [(s["where"], s["reason"]) for s in rep["skipped"]] == [
        ("line 3", "missing image"), ("line 4", "schema"), ("line 5", "unsupported role"),
        ("line 6", "image count mismatch")]
    assert rep["skipped_counts"] == {"missing image": 1, "schema": 1, "unsupported role": 1, "image count mismatch": 1}
    assert validate_file(out, workers=1, progress=False)["num_bad"] == 0


def _image_cell(path):
    with open(path, "rb") as f:
        return {"bytes": f.read(), "path": os.path.basename(path)}


def _parquet(tmp_path):
    """A `datasets`-style parquet: images as {bytes, path} structs, messages as role/content structs."""
    write_images(str(tmp_path / "src_img"))
    img = lambda name: _image_cell(str(tmp_path / "src_img" / name))  # noqa: E731
    msg = lambda *turns: [{"role": r, "content": c} for r, c in turns]  # noqa: E731
    table = pa.table({
        "id": ["p0", "p1", "p2", "p3", "p4"],
        "images": [[img("astro.png")], [img("coffee.jpg"), img("astro.png")], [img("page.png")],
                   [{"bytes": None, "path": "gone.png"}], []],
        "messages": [msg(("user", "<image>\nWhat is shown?"), ("assistant", "A person in a suit.")),
                     msg(("user", "<image><image>Same person?"), ("assistant", "No."),
                         ("user", "And the cup?"), ("assistant", "Coffee.")),
                     msg(("system", "You read documents."), ("user", "<image>Text?"), ("assistant", "Letters.")),
                     msg(("user", "<image>Hm?"), ("assistant", "?")),
                     msg(("user", "No image here."), ("assistant", "Right."))],
        "source": ["web", "web", "docs", "web", "chat"]})
    path = str(tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(table, path, row_group_size=2)
    return path


def test_parquet_images_written_once_and_identical_twice(tmp_path):
    src = _parquet(tmp_path)
    assert detect_format(src) == "parquet"
    out = str(tmp_path / "conv" / "p.jsonl")
    rep = convert_file(src, out, "parquet", progress=False)
    got = _lines(out)
    assert (rep["num_records"], rep["num_converted"], rep["skipped_counts"]) == (5, 4, {"missing image": 1})
    assert rep["skipped"][0]["where"] == "row 3" and "gone.png" in rep["skipped"][0]["detail"]
    images = sorted(os.listdir(tmp_path / "conv" / "images"))
    assert rep["images_written"] == 3 == len(images)  # astro.png is in two rows: one file
    assert got[1]["images"][1] == got[0]["images"][0] and got[0]["images"][0].startswith("images/")
    assert got[0]["image_sizes"] == [[120, 90]] and got[1]["image_sizes"] == [[200, 150], [120, 90]]
    assert got[2]["messages"][0] == {"role": "system", "content": "You read documents."}
    assert got[2]["source"] == "docs" and "images" not in got[3]
    assert validate_file(out, workers=1, progress=False)["num_bad"] == 0
    first = open(out, "rb").read()
    again = convert_file(src, out, "auto", progress=False)
    assert open(out, "rb").read() == first and sorted(os.listdir(tmp_path / "conv" / "images")) == images
    assert again["images_written"] == 0 and again["format"] == "parquet"


def test_auto_detection(tmp_path, llava):
    write_images(str(tmp_path / "img"))
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"images": ["img/astro.png"], "messages": [
        {"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}]}) + "\n")
    llava_jsonl = tmp_path / "llava.jsonl"
    llava_jsonl.write_text("\n" + json.dumps(_llava_records()[0]) + "\n")  # a blank first line: the next decides
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps([{"question": "q", "answer": "a"}]))
    assert detect_format(llava) == "llava"
    assert detect_format(str(llava_jsonl)) == "llava"
    assert detect_format(str(own)) == "jsonl"
    with pytest.raises(ValueError, match="cannot tell the format.*answer, question"):
        detect_format(str(odd))


def test_cli_end_to_end(llava, tmp_path, capsys):
    out, rep = str(tmp_path / "cli" / "out.jsonl"), str(tmp_path / "report.json")
    assert main(["data", "convert", "--from", "auto", llava, out, "--quiet", "--report", rep]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == (f"{llava} (llava) -> {out}: 5 records, 4 converted, 1 skipped (missing image: 1)")
    assert text[1].startswith(f"{llava}: element 3 (line {_element_line(llava, 3)}): missing image: field image: "
                              f"img/missing.jpg not found")
    assert json.load(open(rep))["num_converted"] == 4
    assert main(["data", "validate", out, "--quiet", "--workers", "1"]) == 0
    assert main(["data", "convert", str(tmp_path / "nothing.json"), out]) == 2  # one-line error, no traceback
    assert "input not found" in capsys.readouterr().err


def _samples(cfg):
    """{id: processed sample} of one epoch of the online loader, and its skip log."""
    loader = DataLoader.from_config(cfg, collate=lambda rows: rows)
    got = {s["id"]: s for batch in loader for row in batch for s in row}
    return got, loader.skips.reasons


def _same_samples(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        for key in ("input_ids", "labels", "pixel_values", "image_grid_thw"):
            if a[k][key] is None:
                assert b[k][key] is None, (k, key)
            else:
                np.testing.assert_array_equal(a[k][key], b[k][key], err_msg=f"{k} {key}")


def _online(*sources, dp_rank=0, dp_size=1):
    return DataConfig(packing="online", seq_length=SEQ, online_buffer=4, dp_size=dp_size, dp_rank=dp_rank,
                      sources=list(sources))


@pytest.mark.filterwarnings("ignore:skipping")
def test_training_source_with_format_loads_the_converted_samples(llava, tmp_path):
    out = str(tmp_path / "conv" / "llava.jsonl")
    convert_file(llava, out, "llava", progress=False)
    direct, skips = _samples(_online(DataSource(path=llava, format="llava")))
    converted, none = _samples(_online(DataSource(path=out)))
    assert sorted(direct) == ["5", "a1", "a2", "a3"] and not none
    _same_samples(direct, converted)
    assert skips == {"missing image": {"count": 1, "first": [f"{llava}:4"]}}
    ranks = [_samples(_online(DataSource(path=llava, format="auto"), dp_rank=r, dp_size=2))[0] for r in (0, 1)]
    assert sorted(ranks[0]) == ["5", "a1", "a3"] and sorted(ranks[1]) == ["a2"]  # records 1, 3, 5 / 2, 4 (missing)


@pytest.mark.filterwarnings("ignore:skipping")
def test_training_source_parquet(tmp_path):
    src = _parquet(tmp_path)
    out = str(tmp_path / "conv" / "p.jsonl")
    convert_file(src, out, "parquet", progress=False)
    direct, skips = _samples(_online(DataSource(path=src, format="parquet")))
    _same_samples(direct, _samples(_online(DataSource(path=out)))[0])
    assert sorted(direct) == ["p0", "p1", "p2", "p4"]
    assert skips["missing image"]["first"] == [f"{src}:4"]
    assert len(os.listdir(loader_image_dir(src))) == 3


def test_config_format_field():
    cfg = load(DataConfig, {"sources": [{"path": "x.json", "format": "llava", "image_root": "imgs"}]})
    assert (cfg.sources[0].format, cfg.sources[0].image_root) == ("llava", "imgs")
    assert DataSource(path="x.jsonl").format == "jsonl"
    with pytest.raises(ConfigError, match="format 'alpaca'"):
        load(DataConfig, {"sources": [{"path": "x.json", "format": "alpaca"}]})
    with pytest.raises(ConfigError, match="image_root is for llava"):
        load(DataConfig, {"sources": [{"path": "x.jsonl", "image_root": "imgs"}]})


def test_how_a_source_is_read_is_part_of_its_fingerprint(tmp_path):
    """Changing only a source's `format:` or `image_root:` is a data change on resume (the default jsonl
    reading leaves the fingerprint as it was, so older checkpoints still match)."""
    path = tmp_path / "d.json"
    path.write_text("[]")
    plain = data_fingerprint(load(DataConfig, {"sources": [{"path": str(path)}]}))
    assert not {"format", "image_root"} & set(plain["sources"][0])
    llava = data_fingerprint(load(DataConfig, {"sources": [{"path": str(path), "format": "llava"}]}))
    rooted = data_fingerprint(load(DataConfig, {"sources": [{"path": str(path), "format": "llava",
                                                             "image_root": str(tmp_path)}]}))
    assert fingerprint_diff(plain, llava) == f"{path} changed (format)"
    assert fingerprint_diff(llava, rooted) == f"{path} changed (image_root)"
