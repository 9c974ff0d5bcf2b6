"""Reading the JSON and YAML files that settings name, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import yaml


def _read(path: str | Path, what: str, parse: Callable[[str], Any], error: type[Exception], form: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return parse(path.read_text())
    except error as e:
        raise ValueError(f"{what} {path} is not valid {form}: {e}") from None


def read_json(path: str | Path, what: str) -> Any:
    """The content of JSON file ``path``; ``what`` names it in errors ("profile file")."""
    return _read(path, what, json.loads, json.JSONDecodeError, "JSON")


def read_yaml(path: str | Path, what: str) -> Any:
    """The content of YAML file ``path`` (None when empty)."""
    return _read(path, what, yaml.safe_load, yaml.YAMLError, "YAML")
