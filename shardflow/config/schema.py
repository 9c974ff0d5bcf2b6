"""The machinery of a settings tree: fields that carry their help and their single-field rules.

A settings class is a keyword-only frozen dataclass deriving from ``Settings`` whose fields come
from ``setting`` (a value with one line of help and its rules: ``choices``, bounds ``gt``, ``ge``,
``lt``, ``le``) or ``section`` (a nested settings class). The rules are checked when an instance
is made, from YAML or in code, so a settings object that exists is valid field by field; rules
across fields live in ``runtime.validate``.

``build`` makes a settings tree from a mapping (YAML): an unknown key is reported with the
closest known one, a value of the wrong type or outside its rules with its dotted key. A field
typed ``dict[str, SomeSettings]`` maps names to nested trees (``models.actor.optim.lr``).
``describe`` lists every key with its default, rules and help.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

RULES = ("choices", "gt", "ge", "lt", "le")


class SettingError(ValueError):
    """A settings value that breaks a rule; ``key`` is its dotted name below the object checked."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key} {message}")
        self.key, self.message = key, message

    def under(self, prefix: str) -> "SettingError":
        return SettingError(f"{prefix}.{self.key}" if prefix else self.key, self.message)


def setting(default: Any, help: str, *, choices: Iterable[Any] | None = None, gt: float | None = None,
            ge: float | None = None, lt: float | None = None, le: float | None = None,
            multiple_of: int | None = None, path: str | None = None) -> Any:
    """A field with its default, one line of help and the rules its value must follow. ``path``:
    the value names a file the run reads (``config.load`` resolves it against the config file):
    "file" (any non-empty value), "plan" (a value ending in .yaml or .yml) or "function" (the file
    part of 'file.py:function')."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None,
                "gt": gt, "ge": ge, "lt": lt, "le": le, "multiple_of": multiple_of, "path": path}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, help: str) -> Any:
    """A nested settings class, made with its own defaults."""
    return field(default_factory=cls, metadata={"help": help})


def _broken_rule(meta: Mapping[str, Any], value: Any) -> str | None:
    """What is wrong with ``value`` under the field's rules, or None (None: not set, no rule)."""
    if value is None:
        return None
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        shown = ", ".join(repr(c) if c == "" else str(c) for c in choices)
        return f"must be one of {shown}; got {value!r}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    multiple = meta.get("multiple_of")
    if multiple and value % multiple:
        return f"must be a multiple of {multiple}, got {value!r}"
    gt, ge, lt, le = (meta.get(k) for k in ("gt", "ge", "lt", "le"))
    low_ok = (gt is None or value > gt) and (ge is None or value >= ge)
    high_ok = (lt is None or value < lt) and (le is None or value <= le)
    if low_ok and high_ok:
        return None
    if lt is None and le is None:
        if gt == 0:
            return f"must be positive, got {value!r}"
        if ge == 0:
            return f"must be non-negative, got {value!r}"
        return f"must be {'>' if gt is not None else '>='} {gt if gt is not None else ge}, got {value!r}"
    return f"must be in {_interval(meta)}, got {value!r}"


def _interval(meta: Mapping[str, Any]) -> str:
    gt, ge, lt, le = (meta.get(k) for k in ("gt", "ge", "lt", "le"))
    low = f"({gt}" if gt is not None else f"[{ge}" if ge is not None else "(-inf"
    high = f"{lt})" if lt is not None else f"{le}]" if le is not None else "inf)"
    return f"{low}, {high}"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Base of every settings class: checks each field's rules when an instance is made."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _broken_rule(f.metadata, getattr(self, f.name))
            if problem is not None:
                raise SettingError(f.name, problem)


# ----- from a mapping --------------------------------------------------------------------------


def build(cls: type, raw: Any, where: str = "") -> Any:
    """Instantiate settings class ``cls`` from a mapping, checking keys, types and rules."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {(where + '.' if where else '') + close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {name!r}{hint}")
        kwargs[key] = _convert(hints[key], value, name)
    try:
        return cls(**kwargs)
    except SettingError as e:
        raise e.under(where) from None


def _convert(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, name)
    if typing.get_origin(hint) is dict:
        key_type, item = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            if not isinstance(value, dict):
                raise ValueError(f"{name} must map names to settings, got {value!r}")
            return {str(k): build(item, v, f"{name}.{k}") for k, v in value.items()}
        hint = dict
    expected = hint if isinstance(hint, type) else None
    if isinstance(hint, types.UnionType):
        expected = tuple(a for a in typing.get_args(hint) if isinstance(a, type))
    if typing.get_origin(hint) is list:
        expected = list
    if value is None and isinstance(expected, tuple) and type(None) in expected:
        return None
    if (expected is float or (isinstance(expected, tuple) and float in expected)) and not isinstance(value, bool):
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    if expected is not None and (not isinstance(value, expected)
                                 or (isinstance(value, bool) and expected in (int, float))):
        names = (expected.__name__ if isinstance(expected, type)
                 else " | ".join(t.__name__ for t in expected if t is not type(None)))
        raise ValueError(f"config key {name!r} must be {names}, got {value!r}")
    return value


# ----- help ------------------------------------------------------------------------------------


def describe(cls: type, prefix: str = "", *, choices: Mapping[str, Iterable[str]] | None = None) -> list[str]:
    """One line per key with its default, rules and help (``shardflow train --help-config``).
    ``choices``: allowed values of keys whose choices live above the settings (registries)."""
    choices = choices or {}
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            lines.extend(describe(hint, key + ".", choices=choices))
            continue
        if typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
            lines.append(f"{key} = {{}}  # {f.metadata.get('help', '')}; each <name> has:")
            lines.extend(describe(typing.get_args(hint)[1], f"{key}.<name>.", choices=choices))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"{key} = {default!r}  # {f.metadata.get('help', '')}{_rules_text(f.metadata, choices.get(key))}")
    return lines


def _rules_text(meta: Mapping[str, Any], extra_choices: Iterable[str] | None) -> str:
    allowed = meta.get("choices") or (tuple(extra_choices) if extra_choices is not None else None)
    if allowed:
        return " (one of: " + ", ".join(repr(c) if c == "" else str(c) for c in allowed) + ")"
    if any(meta.get(k) is not None for k in ("gt", "ge", "lt", "le")):
        if meta.get("lt") is None and meta.get("le") is None:
            if 0 in (meta.get("gt"), meta.get("ge")):
                return " (positive)" if meta.get("gt") == 0 else " (non-negative)"
            return f" (> {meta['gt']})" if meta.get("gt") is not None else f" (>= {meta['ge']})"
        return f" (in {_interval(meta)})"
    return ""
