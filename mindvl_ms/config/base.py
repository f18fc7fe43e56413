"""Typed YAML configs: dataclasses whose fields carry a one-line doc, loaded with validation.

Design:
- Every config is a dataclass; every field is declared with `F(default, "doc")` so the YAML
  reference (`config/reference.py` -> docs/CONFIG.md) comes from the code.
- `load(cls, data, source)` converts a nested dict into the dataclass tree. An unknown key is an
  error naming the file, the dotted key and the closest valid key (a key the dataclass lists in its
  `RENAMED_KEYS` is named with its replacement instead); a value of the wrong type is
  an error naming the expected type. After loading, each dataclass's `validate()` (if defined)
  rejects shapes that cannot work.
- A YAML file may start from other files: `_include_: [../model/tiny.yaml]` (paths relative to the
  including file) are deep-merged first, then the file's own keys override. This keeps one YAML
  per model size instead of copy-pasted blocks.
- A `model: FILE.yaml` value, in any section, names a model YAML relative to the file that wrote it
  (`read_yaml` makes it absolute, as it does for `_include_` inside sections); `file_references` lists
  both kinds, which `mindvl init-config` copies along with a config.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import typing
from typing import Any, Dict, List, Optional

import yaml


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names file and key."""


def F(default: Any = dataclasses.MISSING, doc: str = "", **kw) -> Any:
    """A dataclass field with a docstring (`doc`) and a default (lists/dicts copied per instance)."""
    meta = {"doc": doc}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        value = default
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata=meta, **kw)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def sub(cls: type, doc: str) -> Any:
    """A nested dataclass field defaulting to `cls()`."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc})


def _where(source: Optional[str], key: str) -> str:
    return f"{source or '<config>'}: key '{key}'"


def _check_type(tp: Any, value: Any, source: Optional[str], key: str) -> Any:
    """Check/convert `value` against annotation `tp`; returns the converted value."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(a, value, source, key)
            except ConfigError as e:  # try the next member
                errors.append(str(e))
        raise ConfigError(errors[-1] if errors else f"{_where(source, key)}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, key)}: expected a mapping for {tp.__name__}, got {value!r}")
        return load(tp, value, source, prefix=key)
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(source, key)}: expected a list, got {value!r}")
        (et,) = args or (Any,)
        return [_check_type(et, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, key)}: expected a mapping, got {value!r}")
        vt = args[1] if args else Any
        return {k: _check_type(vt, v, source, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{_where(source, key)}: expected a number, got {value!r}")
        try:
            return float(value)  # YAML reads 1e-5 as a string
        except ValueError:
            raise ConfigError(f"{_where(source, key)}: expected a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{_where(source, key)}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{_where(source, key)}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{_where(source, key)}: expected a string, got {value!r}")
        return value
    return value


def load(cls: type, data: Dict[str, Any], source: Optional[str] = None, prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys (with the closest valid key)."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            if key in getattr(cls, "RENAMED_KEYS", {}):  # a key older configs use: name its replacement
                raise ConfigError(f"{_where(source, full)} {cls.RENAMED_KEYS[key]}")
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{_where(source, full)} is not a field of {cls.__name__}{hint}")
        kwargs[key] = _check_type(hints[key], value, source, full)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{source or '<config>'}: {prefix or cls.__name__}: {e}") from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{source or '<config>'}: {prefix + ': ' if prefix else ''}{e}") from None
    return obj


def deep_merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """Recursively merge `over` into a copy of `base` (mappings merge, everything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str) -> Dict[str, Any]:
    """Read a YAML file, resolving `_include_` (a path or list of paths relative to the file)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    inc = data.pop("_include_", None)
    _absolute_refs(data, os.path.dirname(os.path.abspath(path)))
    if inc:
        merged: Dict[str, Any] = {}
        for p in [inc] if isinstance(inc, str) else inc:
            merged = deep_merge(merged, read_yaml(os.path.join(os.path.dirname(path), p)))
        data = deep_merge(merged, data)
    return data


def is_model_file(key: Any, value: Any) -> bool:
    """`model: FILE.yaml`: a `model` key, in any section, whose value names a YAML file."""
    return key == "model" and isinstance(value, str) and value.endswith((".yaml", ".yml"))


def file_references(data: Dict[str, Any]) -> List[str]:
    """The files a YAML mapping refers to, as written: `_include_` entries and `model: FILE.yaml` values, at
    any depth (`mindvl init-config` copies them along with the file)."""
    refs: List[str] = []
    for key, val in data.items():
        if key == "_include_" and val:
            refs += [val] if isinstance(val, str) else list(val)
        elif is_model_file(key, val):
            refs.append(val)
        elif isinstance(val, dict):
            refs += file_references(val)
    return refs


def _absolute_refs(data: Dict[str, Any], base_dir: str) -> None:
    """Make the file references of a file's sections (`model: FILE.yaml` and `_include_` in any section)
    absolute, so they stay relative to the file that wrote them when another file `_include_`s it."""
    for key, val in data.items():
        if is_model_file(key, val):
            data[key] = os.path.join(base_dir, val)
        elif isinstance(val, dict):
            if "_include_" in val:
                inc = val["_include_"]
                val["_include_"] = [os.path.join(base_dir, p) for p in ([inc] if isinstance(inc, str) else inc)]
            _absolute_refs(val, base_dir)


def set_dotted(data: Dict[str, Any], dotted: str, value: Any) -> None:
    """Apply one `--set a.b.c=value` override (value parsed as YAML) to a nested dict."""
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a mapping")
    cur[keys[-1]] = yaml.safe_load(value) if isinstance(value, str) else value


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (for JSON/YAML dumps)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
