"""Every .md file the package's code, the README or the docs refer to exists in the repository.

A reference is any `name.md` or `dir/name.md` token; it must exist relative to the repository root or
under docs/. Markdown files the code writes as outputs are listed in OUTPUTS, each with the module that
writes it (checked: the name appears there inside an os.path.join call).
"""
import os
import re

from tests.support.paths import ROOT  # noqa: E402
REF = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w.-]+\.md)\b")
OUTPUTS = {"resolution_table.md": "mindvl_ms/eval/resolution_search.py"}


def _files(top, ext):
    for d, _, fs in os.walk(os.path.join(ROOT, top)):
        if "__pycache__" not in d:
            yield from (os.path.join(d, f) for f in fs if f.endswith(ext))


def _refs(path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            for m in REF.finditer(line):
                if "://" not in line[max(0, m.start() - 60):m.start()]:  # not part of a URL
                    yield n, m.group(1)


def _exists(ref):
    return os.path.isfile(os.path.join(ROOT, ref)) or os.path.isfile(os.path.join(ROOT, "docs", ref))


def test_code_and_docs_reference_existing_markdown():
    sources = list(_files("mindvl_ms", ".py")) + list(_files("docs", ".md")) + [os.path.join(ROOT, "README.md")]
    missing, seen = [], set()
    for path in sources:
        for n, ref in _refs(path):
            seen.add(ref)
            if ref in OUTPUTS:
                continue
            if not _exists(ref):
                missing.append(f"{os.path.relpath(path, ROOT)}:{n}: {ref}")
    assert not missing, "references to missing .md files:\n" + "\n".join(missing)
    # the docs the package points at are really referenced (the scan is not vacuous)
    assert {"docs/DATA.md", "docs/CHECKPOINTS.md", "docs/CONFIG.md", "README.md"} <= seen


def test_output_markdown_names_are_written_by_their_module():
    for name, module in OUTPUTS.items():
        text = open(os.path.join(ROOT, module), encoding="utf-8").read()
        assert re.search(r"os\.path\.join\([^)]*\"" + re.escape(name) + "\"", text), (name, module)


def test_the_scanner_finds_a_missing_file(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""see DESIGN.md "Data format" and docs/DATA.md; https://x.org/a.md"""\n')
    refs = [r for _, r in _refs(str(p))]
    assert refs == ["DESIGN.md", "docs/DATA.md"]
    assert not _exists("DESIGN.md") and _exists("docs/DATA.md") and _exists("ARCHITECTURE.md")
