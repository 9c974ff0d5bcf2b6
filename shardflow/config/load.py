"""An experiment's settings from YAML plus dotted overrides (``key.sub=value``).

Paths that the run reads (model directories, the dataset, a plan file, step times, a reward
file) are relative to the config file, whichever command reads it; without a file, to the
working directory. Outputs (``run.out_dir``) are relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from shardflow.config.experiment import RENAMED, ExperimentConfig
from shardflow.config.files import read_yaml
from shardflow.config.schema import build


def load_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None) -> ExperimentConfig:
    """Read YAML (or start from ``base``), apply ``key.sub=value`` overrides, build the settings
    tree (keys, types and single-field rules checked) and resolve its input paths."""
    raw: dict[str, Any] = dict(base or {})
    if path is not None:
        path = Path(path)
        loaded = read_yaml(path, "config file") or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping at the top level")
        raw = merge(raw, loaded)
    for item in overrides:
        raw = merge(raw, parse_override(item))
    for old, new in RENAMED.items():
        section, _, key = old.rpartition(".")
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ValueError(f"config key {old!r} is now {new!r}")
    config = build(ExperimentConfig, raw)
    return resolve_paths(config, path.parent if path is not None else None)


def parse_override(item: str) -> dict[str, Any]:
    """``"a.b.c=3"`` -> ``{"a": {"b": {"c": 3}}}`` (the value is read as YAML)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key.sub=value")
    key, _, text = item.partition("=")
    value = yaml.safe_load(text) if text else ""
    for part in reversed(key.strip().split(".")):
        if not part:
            raise ValueError(f"override {item!r} has an empty key part")
        value = {part: value}
    return value


def merge(a: dict, b: dict) -> dict:
    """``b`` over ``a``, mappings merged key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_paths(settings: Any, base: Path | None) -> Any:
    """``settings`` with every relative input path (fields declared with ``path``) joined to
    ``base``; unchanged when ``base`` is None."""
    if base is None:
        return settings
    changes = {}
    hints = typing.get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            changes[f.name] = resolve_paths(value, base)
        elif typing.get_origin(hints[f.name]) is dict and dataclasses.is_dataclass(typing.get_args(hints[f.name])[1]):
            changes[f.name] = {k: resolve_paths(v, base) for k, v in value.items()}
        elif f.metadata.get("path") and isinstance(value, str):
            changes[f.name] = _resolved(value, f.metadata["path"], base)
        elif f.metadata.get("path") and isinstance(value, list):
            changes[f.name] = [_resolved(v, f.metadata["path"], base) if isinstance(v, str) else v for v in value]
    return dataclasses.replace(settings, **changes)


def _resolved(value: str, kind: str, base: Path) -> str:
    if kind == "function":
        file, sep, name = value.rpartition(":")
        return f"{_joined(file, base)}{sep}{name}" if file.endswith(".py") else value
    if kind == "plan" and not value.endswith((".yaml", ".yml")):
        return value  # a plan's name ("symmetric"), not a file
    return _joined(value, base) if value else value


def _joined(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)
