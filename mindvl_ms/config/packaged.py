"""The YAML configs shipped with the package, found from any working directory.

The repository keeps its configs in the top-level `configs/` directory; `setup.py` maps that directory to
the package `mindvl_ms.configs` (`package_dir`), so a wheel installs them as `mindvl_ms/configs/**.yaml`.
`configs_dir()` finds them through `importlib.resources` (installed wheel) and falls back to the source
checkout's `configs/` (editable install, PYTHONPATH on a checkout).

- `resolve_config("configs/stage/tiny-cpu.yaml")`: a path that exists (relative to the working directory
  or absolute) is used as given; otherwise the same name inside the packaged configs (with or without the
  leading `configs/`) is used and the log says so. `mindvl train --config` and `mindvl demo --config` use it.
- `copy_config(name, dst)`: `mindvl init-config NAME [DST]` copies a packaged config and every file it
  refers to (`_include_` entries and `model: FILE.yaml` values, in any section), keeping their relative
  paths, so the copy loads exactly like the original and can be edited.
"""
from __future__ import annotations

import logging
import os
import shutil
from importlib.resources import files
from typing import List, Tuple

import yaml

from mindvl_ms.config.base import file_references

log = logging.getLogger(__name__)

PREFIX = "configs"


def configs_dir() -> str:
    """Directory holding the packaged YAML configs (model/, stage/, parallel/, demo/)."""
    candidates = []
    try:
        candidates.append(os.fspath(files("mindvl_ms").joinpath(PREFIX)))
    except TypeError:  # a zipped install has no file-system path; use the fallback
        pass
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../mindvl_ms
    candidates += [os.path.join(pkg, PREFIX), os.path.join(os.path.dirname(pkg), PREFIX)]
    for c in candidates:
        if os.path.isdir(os.path.join(c, "model")):
            return c
    raise FileNotFoundError(f"the packaged configs are missing (looked in {', '.join(candidates)}); reinstall "
                            "mindvl-ms, or pass a config file that exists")


def list_configs() -> List[str]:
    """Names of the packaged configs relative to configs_dir(), e.g. 'demo/quick.yaml'."""
    root = configs_dir()
    out = []
    for d, _, fs in os.walk(root):
        out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in fs if f.endswith(".yaml")]
    return sorted(out)


def _packaged_name(path: str) -> str:
    p = path.replace(os.sep, "/").lstrip("./")
    return p[len(PREFIX) + 1:] if p.startswith(PREFIX + "/") else p


def packaged_path(name: str) -> str:
    """The packaged file for `name` ('demo/quick.yaml' or 'configs/demo/quick.yaml'); clear error if none."""
    full = os.path.join(configs_dir(), _packaged_name(name))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no packaged config {_packaged_name(name)!r}; available: {', '.join(list_configs())}")
    return full


def resolve_config(path: str) -> Tuple[str, bool]:
    """(file to read, whether it is the packaged copy). An existing path wins; otherwise the packaged
    config of the same name; otherwise FileNotFoundError naming both places."""
    if os.path.isfile(path):
        return path, False
    if os.path.isabs(path):
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        full = packaged_path(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"config file not found: {path} (not relative to {os.getcwd()}); {e}") from None
    log.info("config %s not found relative to %s: using the packaged copy %s", path, os.getcwd(), full)
    return full, True


def _references(path: str) -> List[str]:
    """Files a config refers to, relative to it: `_include_` entries and `model: FILE.yaml` values, at any
    depth (the same references `base.read_yaml` resolves against the file)."""
    with open(path, encoding="utf-8") as f:
        return file_references(yaml.safe_load(f) or {})


def copy_config(name: str, dst: str = PREFIX, overwrite: bool = False) -> List[str]:
    """Copy packaged config `name` and the files it refers to (recursively) under `dst`, keeping the
    layout of the packaged tree; returns the written paths (the requested config first)."""
    root = configs_dir()
    todo, seen = [_packaged_name(os.path.relpath(packaged_path(name), root))], []
    while todo:
        rel = os.path.normpath(todo.pop(0))
        if rel in seen:
            continue
        src = os.path.join(root, rel)
        if rel.startswith("..") or not os.path.isfile(src):
            raise FileNotFoundError(f"packaged config {name!r} refers to {rel!r}, which is not a packaged file")
        seen.append(rel)
        todo += [os.path.join(os.path.dirname(rel), r) for r in _references(src)]
    targets = [os.path.join(dst, rel) for rel in seen]
    existing = [t for t in targets if os.path.exists(t)]
    if existing and not overwrite:
        raise FileExistsError(f"would overwrite {', '.join(existing)} (use --force)")
    for rel, t in zip(seen, targets):
        os.makedirs(os.path.dirname(t) or ".", exist_ok=True)
        shutil.copyfile(os.path.join(root, rel), t)
    return targets
