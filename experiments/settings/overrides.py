"""Strict `key=value` overrides of frozen config dataclasses.

An unknown key or a value of the wrong type is an error that names the key and what would be
right; an override never adds a new setting.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Iterable


class OverrideError(ValueError):
    """A `--set key=value` that does not fit the config."""


def parse_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise OverrideError(f"override {text!r} is not of the form key=value")
    return key.strip(), value.strip()


def apply_overrides(config: Any, assignments: Iterable[str]) -> Any:
    """Return a copy of `config` with every `dotted.key=value` applied, in order."""
    for text in assignments:
        key, value = parse_assignment(text)
        config = _set(config, key.split("."), value, key)
    return config


def _set(obj: Any, path: list[str], raw: str, full_key: str) -> Any:
    if not dataclasses.is_dataclass(obj):
        raise OverrideError(f"{full_key!r}: cannot set a field inside a {type(obj).__name__}")
    fields = {f.name: f for f in dataclasses.fields(obj) if f.init}
    name = path[0]
    if name not in fields:
        raise OverrideError(
            f"unknown key {full_key!r}: {type(obj).__name__} has {', '.join(sorted(fields))}"
        )
    current = getattr(obj, name)
    if len(path) > 1:
        return dataclasses.replace(obj, **{name: _set(current, path[1:], raw, full_key)})
    if dataclasses.is_dataclass(current):
        raise OverrideError(f"{full_key!r} is a section; set one of its keys, e.g. {full_key}.KEY=VALUE")
    hint = typing.get_type_hints(type(obj))[name]
    try:
        return dataclasses.replace(obj, **{name: coerce(raw, hint)})
    except (TypeError, ValueError) as err:
        # A validator's message often starts by naming the setting again: say it once.
        text = str(err)
        for echo in (f"{name}={raw!r}: ", f"{name}={raw}: "):
            text = text.removeprefix(echo)
        raise OverrideError(f"--set {full_key}={raw}: {text}") from None


def coerce(raw: str, hint: Any) -> Any:
    """Convert the text of an override to the type `hint`, refusing anything else."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if type(None) in args and raw.lower() in ("none", "null", ""):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(raw, arg)
            except (TypeError, ValueError) as err:
                errors.append(str(err))
        raise ValueError("; ".join(errors))
    if origin is typing.Literal:
        if raw not in args:
            raise ValueError(f"expected one of {', '.join(map(str, args))}")
        return raw
    if origin is tuple:
        items = [s for s in raw.strip("()[]").split(",") if s.strip()]
        item_type = args[0] if args else str
        return tuple(coerce(s.strip(), item_type) for s in items)
    if hint is bool:
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError("expected a boolean (true/false)")
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError("expected an integer") from None
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError("expected a number") from None
    if hint is str:
        return raw
    raise TypeError(f"cannot override a field of type {hint}")


def to_dict(config: Any) -> dict:
    """A JSON-ready dict of a (nested) config dataclass, with each section's type recorded."""
    out: dict[str, Any] = {"_type": type(config).__name__}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def from_dict(cls: type, data: dict, section_types: dict[str, type]) -> Any:
    """Rebuild a config written by `to_dict`; `section_types` maps recorded type names to classes."""
    kwargs = {}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key == "_type":
            continue
        if key not in names:
            raise OverrideError(f"unknown key {key!r} in saved {cls.__name__}")
        if isinstance(value, dict):
            sub = section_types.get(value.get("_type", ""))
            if sub is None:
                raise OverrideError(f"unknown section type {value.get('_type')!r} for {key!r}")
            kwargs[key] = from_dict(sub, value, section_types)
        elif isinstance(value, list):
            kwargs[key] = tuple(value)
        else:
            if hints.get(key) is float and isinstance(value, int):
                value = float(value)
            kwargs[key] = value
    return cls(**kwargs)


def dumps(config: Any) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True)
