"""Fuzzed data input: generated malformed lines mixed with good ones through `mindvl data validate`,
`mindvl data pack` and the online loader (tests/data/fuzz_lines.py builds and labels the lines).

For every generated file: no reader raises (no traceback, no catch-all "error" reason: each bad line is
named by file and line with a specific reason); every bad line is named by each reader that must see it;
every good line comes out of the online loader in a batch (`build_model_inputs`), exactly once; the counts
add up (validate: ok + bad == lines; pack: packed + dropped == lines; loader: trained + skipped == lines).
Hypothesis draws EXAMPLES files of LINES_PER_FILE line specs (template, mutation or none, seed), derandomized;
the readers run as in use: the CLI commands with one worker, the online loader with `build_model_inputs`.
The crashes the fuzz found are kept below as plain one-line cases (`test_fuzz_finding_is_named_by_every_reader`).

    python -m pytest -q tests/data/test_fuzz.py
"""
import io
import json
import os
import re
import shutil
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from typing import Dict, List, Set

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from mindvl_ms.cli import main
from mindvl_ms.config.base import load
from mindvl_ms.config.data import DataConfig
from mindvl_ms.config.model import MindVLConfig
from mindvl_ms.data.collate import build_model_inputs
from mindvl_ms.data.dataset import DataLoader
from mindvl_ms.data import offline
from mindvl_ms.data.offline import sample_meta
from mindvl_ms.data.processor import MindVLProcessor
from mindvl_ms.data.schema import SampleError, parse_sample
from tests.data.fuzz_lines import (DATA_SECTION, MUTATION_NAMES, SEQ, TEMPLATES, Line, build_line, build_world,
                                   write_lines)

LINES_PER_FILE = 230
EXAMPLES = 10
MIN_LINES = 2000


def _cli(argv: List[str]):
    """(exit code, stdout, stderr) of `mindvl ...`; stdout is strict UTF-8 as on a terminal."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(argv)
    return rc, out.buffer.getvalue().decode("utf-8"), err.getvalue()


def run_validate(src: str, config: str) -> Dict:
    report = src + ".report.json"
    rc, out, err = _cli(["data", "validate", src, "--config", config, "--workers", "1", "--quiet",
                         "--max-list", "100000", "--report", report])
    assert rc in (0, 1) and not err.strip(), (rc, err)
    with open(report, encoding="utf-8") as f:
        rep = json.load(f)
    rep["stdout"] = out
    return rep


def run_pack(src: str, config: str, out_dir: str) -> Dict:
    rc, out, err = _cli(["data", "pack", src, out_dir, "--config", config, "--workers", "1", "--quiet"])
    assert rc == 0 and "Traceback" not in err, (rc, err)
    with open(os.path.join(out_dir, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def run_loader(src: str, proc: MindVLProcessor, model: MindVLConfig):
    """(lines in batches, loader) of one epoch of the online loader over `src`."""
    cfg = load(DataConfig, dict(DATA_SECTION, packing="online", sources=[{"path": src}]))
    lines = []

    def collate(rows):
        batch = build_model_inputs(rows, model, pad_to=SEQ)
        lines.extend(s["line"] for row in rows for s in row)
        return batch
    loader = DataLoader.from_config(cfg, processor=proc, collate=collate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in loader:
            pass
    return lines, loader


def _same_lines(reader: str, named: Dict[int, str], want: Set[int], where: Dict[int, str]) -> None:
    """`named` (line -> reason) holds exactly the lines `want`, none with the catch-all reason "error"."""
    crashed = [(where[k], r) for k, r in sorted(named.items()) if r == "error"]
    assert not crashed, f"{reader}: a line failed with no named reason (a traceback caught): {crashed[:5]}"
    missing, extra = sorted(want - set(named)), sorted(set(named) - want)
    assert not missing and not extra, (f"{reader}: bad lines not named: {[where[k] for k in missing][:5]}; "
                                       f"good lines named: {[(where[k], named[k]) for k in extra][:5]}")


def check_validate(src: str, config: str, n: int, bad: Set[int], where: Dict[int, str]) -> None:
    rep = run_validate(src, config)
    _same_lines("validate", {e["line"]: e["reason"] for e in rep["errors"]}, bad, where)
    assert rep["num_lines"] == n and rep["num_ok"] + rep["num_bad"] == n and rep["num_bad"] == len(bad)
    printed = {int(m.group(1)) for m in re.finditer(rf"^{re.escape(src)}:(\d+): ", rep["stdout"], re.M)}
    assert printed == bad  # every bad line on stdout as file:line: reason: detail


def check_pack(src: str, config: str, n: int, bad: Set[int], where: Dict[int, str]) -> None:
    man = run_pack(src, config, src + ".packed")
    _same_lines("pack", {d["line"]: d["reason"] for d in man["dropped"]}, bad, where)
    assert sorted(k for p in man["packs"] for k in p["lines"]) == sorted(set(range(1, n + 1)) - bad)
    assert man["num_lines"] == n and man["num_samples"] + len(man["dropped"]) == n


def check_loader(src: str, proc, model, n: int, bad: Set[int], where: Dict[int, str]) -> int:
    """The online loader's epoch: the good lines come out in batches once each, the bad ones are skipped
    as file:line; returns the number trained."""
    trained, loader = run_loader(src, proc, model)
    skipped = {}
    for s in loader.skipped:  # "file:line: reason: detail"
        assert s.startswith(src + ":"), s
        k, reason, _ = s[len(src) + 1:].split(": ", 2)
        skipped[int(k)] = reason
    _same_lines("load", skipped, bad, where)
    assert sorted(trained) == sorted(set(range(1, n + 1)) - bad)
    stats = loader.skip_stats()
    assert (stats["epoch_seen"], stats["epoch_skipped"], stats["epoch_total"]) == (n, len(bad), n)
    return len(trained)


def check_file(src: str, lines: List[Line], config: str, proc, model) -> Dict[str, int]:
    """Run the three readers over `src` and check the properties (module doc); returns counts."""
    n = len(lines)
    where = {k: f"line {k}: {x.kind}: {x.raw[:160]!r}" for k, x in enumerate(lines, 1)}
    bad = {r: {k for k, x in enumerate(lines, 1) if r in x.bad} for r in ("validate", "pack", "load")}
    check_validate(src, config, n, bad["validate"], where)
    try:
        check_pack(src, config, n, bad["pack"], where)
    finally:
        shutil.rmtree(src + ".packed", ignore_errors=True)
    trained = check_loader(src, proc, model, n, bad["load"], where)
    return {"lines": n, "bad_named": len(bad["validate"] | bad["pack"] | bad["load"]), "trained": trained}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz"))
    w = build_world(root)
    config = os.path.join(root, "data.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"data": DATA_SECTION}, f)
    cfg = load(DataConfig, DATA_SECTION)
    proc = MindVLProcessor(config=cfg)

    def same_processor(config: DataConfig) -> MindVLProcessor:
        assert config == cfg, "`mindvl data pack` read another data section than the loader's"
        return proc
    # `mindvl data pack` builds a processor from the file's data section (the tokenizer load is most of a
    # pack's time): it gets the loader's one, built from the same section
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offline, "MindVLProcessor", same_processor)
        yield w, config, proc, MindVLConfig()


SPEC = st.tuples(st.integers(0, len(TEMPLATES) - 1), st.one_of(st.none(), st.sampled_from(MUTATION_NAMES)),
                 st.integers(0, 2 ** 32 - 1))


@pytest.mark.slow
def test_fuzzed_lines_are_named_good_lines_train_counts_add_up(world):
    w, config, proc, model = world
    totals = {"files": 0, "lines": 0, "bad_named": 0, "trained": 0}
    t0 = time.perf_counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate),  # no shrinking: the failure message names the lines
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(specs=st.lists(SPEC, min_size=LINES_PER_FILE, max_size=LINES_PER_FILE))
    def fuzz(specs):
        lines = [build_line(w, n, *spec) for n, spec in enumerate(specs, 1)]
        src = write_lines(os.path.join(w.root, f"fuzz{totals['files']}.jsonl"), lines)
        totals["files"] += 1
        for k, v in check_file(src, lines, config, proc, model).items():
            totals[k] += v

    fuzz()
    assert totals["files"] == EXAMPLES and totals["lines"] >= MIN_LINES, totals
    assert 0 < totals["trained"] < totals["lines"] and totals["bad_named"] > 0, totals
    print(f"fuzz: {totals} in {time.perf_counter() - t0:.1f}s")


# -------------------------------------------------------------------------------------------------------------
# the crashes the fuzz found, one line each: (line, {reader: (reason, fragments of the detail) or None})

def _text(answer="a cat", **kw):
    return {"messages": [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": answer}], **kw}


def _image(path, **kw):
    return {"images": [path], "messages": [{"role": "user", "content": "<image>What is it?"},
                                           {"role": "assistant", "content": "a cat"}], **kw}


def _line(obj, **raw) -> bytes:
    """`obj` as JSON with each string "@K" replaced by the raw JSON text raw[K]."""
    text = json.dumps(obj)
    for k, v in raw.items():
        text = text.replace(f'"@{k}"', v)
    return text.encode()


def _all(reason, *fragments):
    return {r: (reason, fragments) for r in ("validate", "pack", "load")}


_UNREADABLE = ("unreadable image", ("field images[0]", "bomb.png", "decompression bomb"))
REGRESSIONS = {
    "integer of 5000 digits": (_line(_text(id="@id"), id="7" * 5000), _all("invalid json", "5000 digits")),
    "nesting past the recursion limit": (_line(_text(meta="@m"), m="[" * 20000 + "]" * 20000),
                                         _all("invalid json", "nested deeper")),
    "lone surrogate in the text": (_line(_text(answer="@a"), a='"a cat\\ud800"'),
                                   _all("schema", "field 'messages[1].content'", "\\ud800")),
    "lone surrogate in free-form metadata": (_line(_text(meta={"note": "@n"}), n='"x\\udfff"'),
                                             _all("schema", "field 'meta.note'", "\\udfff")),
    "undecodable byte in a key": (_line(_text()).replace(b'"role"', b'"ro\xe9le"', 1),
                                  _all("undecodable bytes", "byte 0xe9", "field 'messages[0].ro\\xe9le (the key)'")),
    "encoded surrogate in a field name": (_line(_text(task="@t"), t="1").replace(b'"task"', b'"\xed\xa0\x80task"'),
                                          _all("undecodable bytes", "byte 0xed")),
    "decompression bomb header": (_line(_image("img/bomb.png")),
                                  {"validate": ("corrupt image", ("bomb.png",)), "pack": _UNREADABLE,
                                   "load": _UNREADABLE}),
    "raw vision token in the text": (_line(_image("img/astro.png")).replace(b"What", b"<|image_pad|>What"),
                                     _all("raw vision token", "messages[0]", "<|image_pad|>")),
    "truncated image (header readable)": (_line(_image("img/trunc.png")),
                                          {"validate": ("corrupt image", ("trunc.png",)), "pack": None,  # headers
                                           "load": ("unreadable image",
                                                    ("field images[0]", "trunc.png", "truncated"))}),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_fuzz_finding_is_named_by_every_reader(world, case):
    """A line the fuzz found crashing a reader (or passing one that must reject it), after a good line: each
    reader names it with the expected reason and field, and the good line still trains."""
    w, config, proc, model = world
    raw, want = REGRESSIONS[case]
    src = write_lines(os.path.join(w.root, "regression.jsonl"),
                      [Line(json.dumps(_text()).encode(), "good", frozenset()), Line(raw, case, frozenset())])
    rep = run_validate(src, config)
    got = {"validate": [(e["reason"], e["detail"]) for e in rep["errors"] if e["line"] == 2]}
    man = run_pack(src, config, src + ".packed")
    shutil.rmtree(src + ".packed")
    got["pack"] = [(d["reason"], d.get("detail", "")) for d in man["dropped"] if d["line"] == 2]
    trained, loader = run_loader(src, proc, model)
    got["load"] = [tuple(s[len(src) + 4:].split(": ", 1)) for s in loader.skipped if s.startswith(f"{src}:2: ")]
    for reader, exp in want.items():
        if exp is None:
            assert got[reader] == [], (reader, got[reader])
            continue
        reason, fragments = exp
        assert [r for r, _ in got[reader]] == [reason], (reader, got[reader])
        assert all(f in got[reader][0][1] for f in fragments), (reader, got[reader][0][1], fragments)
    assert 1 in trained and 2 not in trained


def test_trusted_metadata_past_the_float_range_is_a_bad_size(world):
    """`mindvl data pack --trust-image-sizes` counts tokens from the line's numbers alone: a size or frame
    count too large for a float is the line's error, named by field, not an OverflowError."""
    w, _, proc, _ = world
    src = os.path.join(w.root, "trusted.jsonl")
    cases = [(_image("img/astro.png", image_sizes=[[10 ** 400, 10 ** 400]]), "bad image size", "field image_sizes"),
             ({"videos": ["vid/clip.mkv"], "video_meta": [{"frames": 10 ** 400, "fps": 4, "width": 56, "height": 56}],
               "messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "a"}]},
              "bad video", "field videos")]
    for k, (obj, reason, field) in enumerate(cases, 1):
        with pytest.raises(SampleError) as e:
            sample_meta(proc, parse_sample(obj, src, k), check_sizes=False)
        assert (e.value.reason, e.value.line) == (reason, k) and e.value.detail.startswith(field), e.value
