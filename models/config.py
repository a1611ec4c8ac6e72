"""The one config mechanism: typed dataclasses, YAML files, dotted ``key=value`` overrides.

Every entry point describes its settings as a (nested) dataclass with a docstring under each field
and cross-field checks in ``__post_init__``. ``parse_cli`` reads ``--config recipe.yaml`` and then
applies overrides such as ``train.lr=3e-4 drafter.ttt_steps=3``; values are parsed as YAML scalars
and checked against the field's annotation, so a typo in a key or a wrong type fails before any
compute.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    pass


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` (ints widen to floats; None only for Optional)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{where}: None is not allowed")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {typing.get_args(tp)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "2e-4" (no dot) as a string; accept any float literal
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported annotation {tp!r}")


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys and type mismatches raise ConfigError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def to_dict(cfg: Any) -> dict:
    """Plain-YAML view of a config (tuples become lists)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings to a nested mapping (value parsed as a YAML scalar/list)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + overrides → validated ``cls`` instance."""
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded or {}
    return from_dict(cls, apply_overrides(data, list(overrides or [])))


def _field_docs(cls: type) -> dict[str, str]:
    """The first line of the docstring under each field of ``cls`` (and its bases), read from the source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # built at run time, or a builtin: no source to read
            continue
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[node.target.id] = (str(after.value.value).strip().splitlines() or [""])[0]
    return docs


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per setting of ``cls``: ``dotted.key = default  doc``, sections recursed into."""
    lines, hints, docs = [], typing.get_type_hints(cls), _field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            lines += describe(hints[f.name], key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        doc = docs.get(f.name, "")
        lines.append(f"  {key} = {default}" + (f"  # {doc}" if doc else ""))
    return lines


def parse_cli(cls: type[T], argv: list[str]) -> T:
    """``[--config FILE] [key=value ...]`` → config (the syntax every entry script shares); ``--help`` prints
    every setting with its default and exits."""
    path, overrides, args = None, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--help", "-h"):
            print("usage: [--config FILE.yaml] [key=value ...]\n\nsettings (key = default):")
            print("\n".join(describe(cls)))
            raise SystemExit(0)
        if arg in ("--config", "-c"):
            if not args:
                raise ConfigError("--config needs a file")
            path = args.pop(0)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown flag {arg!r}: use --config FILE and key=value overrides")
        else:
            overrides.append(arg)
    return load_config(cls, path, overrides)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
