"""Command-line options generated from a config Struct, and the Struct back from them.

A config tree (prototype/config.py's `ServerConfig`, sim's `CompareConfig`) is the one
statement of its options: each leaf field becomes one flag named after it (`max_cache_bytes`:
`--max-cache-bytes`; a field may name its own flag with `Meta(extra={"flag": ...})`), typed and
documented from the field's type and `Meta(description=...)`. A nested Struct field's leaves
are flags of the same parser, so leaf names are unique across a tree (checked here). Options
not given are left out of the namespace (`argparse.SUPPRESS`), so the Struct's own defaults
apply, and `struct_from_args` validates what was given with msgspec.

Value syntax: a boolean is a switch (`--no-X` too when it defaults to true); a field that may
be None takes `none`; a collection takes a comma-separated list; a `Literal` or an enum lists
its choices. A union of a string and a Struct (a cost profile: a name, a file, or the values)
takes the string.
"""

from __future__ import annotations

import argparse
import enum
import functools
import re
import typing
from collections.abc import Iterator
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

S = TypeVar("S", bound=msgspec.Struct)

__all__ = [
    "OneLineParser",
    "add_struct_options",
    "flag_of",
    "get_leaf",
    "leaves",
    "option_error",
    "replace_leaves",
    "struct_from_args",
]

_SCALARS: dict[type[mi.Type], type] = {mi.IntType: int, mi.FloatType: float, mi.StrType: str}
_COLLECTIONS = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)


def _unwrap(t: mi.Type) -> tuple[mi.Type, dict[str, Any], dict[str, Any]]:
    """The type under `Annotated` metadata, its JSON-schema extras and its `extra` dict."""
    schema: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    while isinstance(t, mi.Metadata):
        schema.update(t.extra_json_schema or {})
        extra.update(t.extra or {})
        t = t.type
    return t, schema, extra


def _struct_of(t: mi.Type) -> type[msgspec.Struct] | None:
    return t.cls if isinstance(t, mi.StructType) else None


def leaves(cls: type[msgspec.Struct], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], mi.Field]]:
    """Every leaf field of `cls` with its path of field names (nested Structs descended)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for field in info.fields:
        inner, _, _ = _unwrap(field.type)
        nested = _struct_of(inner)
        if nested is not None:
            yield from leaves(nested, (*path, field.name))
        else:
            yield (*path, field.name), field


def flag_of(field: mi.Field) -> str:
    _, _, extra = _unwrap(field.type)
    return str(extra.get("flag") or "--" + field.name.replace("_", "-"))


def _none_or(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _shown(value: Any) -> str:
    if isinstance(value, frozenset | set | tuple | list):
        items = [str(v.value if isinstance(v, enum.Enum) else v) for v in value]
        return ",".join(sorted(items) if isinstance(value, frozenset | set) else items) or "(none)"
    if isinstance(value, msgspec.Struct):
        return str(getattr(value, "name", type(value).__name__))
    return "none" if value is None else str(value)


def add_struct_options(
    p: argparse.ArgumentParser,
    cls: type[msgspec.Struct],
    *,
    skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """One option per leaf field of `cls` (but those named in `skip`). `defaults` gives a
    command's own default for a leaf, by name (`results`' modes): the help shows it, and it is
    passed as if given; the Struct's default applies to the others."""
    seen: dict[str, tuple[str, ...]] = {}
    own = defaults or {}
    unknown = set(own) - {path[-1] for path, _ in leaves(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no leaf {sorted(unknown)}")
    struct_defaults = cls()
    for path, field in leaves(cls):
        if field.name in skip:
            continue
        if field.name in seen:
            raise ValueError(f"{cls.__name__}: leaf {field.name!r} at {path} and at {seen[field.name]}")
        seen[field.name] = path
        default: Any = struct_defaults
        for name in path:
            default = getattr(default, name)
        default = own.get(field.name, default)
        t, schema, extra = _unwrap(field.type)
        text = schema.get("description", "")
        help_text = f"{text} (default: {_shown(default)})" if text else f"default: {_shown(default)}"
        flag = flag_of(field)
        common: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": help_text}
        if field.name in own:  # given as its text, which the flag's type parses as argparse does a string default
            common["default"] = _shown(default)
            common["help"] = f"{text} (default: %(default)s)"  # so the help formatter adds no second one
        if "choices" in extra:  # a string from a registry: argparse lists and checks its names
            common["choices"] = list(extra["choices"])
        optional = isinstance(t, mi.UnionType) and any(isinstance(u, mi.NoneType) for u in t.types)
        if isinstance(t, mi.UnionType):  # X | None, or str | Struct
            kinds = [_unwrap(u)[0] for u in t.types if not isinstance(u, mi.NoneType | mi.StructType)]
            t = kinds[0] if len(kinds) == 1 else mi.StrType()
        if isinstance(t, mi.BoolType):
            action = argparse.BooleanOptionalAction if default else "store_true"
            p.add_argument(flag, action=action, **common)
        elif isinstance(t, mi.LiteralType):
            p.add_argument(flag, choices=[str(v) for v in t.values], **common)
        elif isinstance(t, mi.EnumType):
            p.add_argument(flag, choices=[str(m.value) for m in t.cls], **common)
        elif isinstance(t, _COLLECTIONS):
            p.add_argument(flag, type=_comma_list, metavar="A,B,...", **common)
        else:
            kind = next((v for k, v in _SCALARS.items() if isinstance(t, k)), str)
            if optional and kind is not str:  # a limit that `none` lifts
                common["help"] = f"{help_text.removesuffix(')')}; none: no limit)"
            p.add_argument(flag, type=_none_or(kind) if optional else kind, **common)


def struct_from_args(
    args: argparse.Namespace, cls: type[msgspec.Struct], *, base: msgspec.Struct | None = None, **given: Any
) -> Any:
    """The config of `cls` from parsed options: the options given, over `base` (default: the
    Struct's defaults; `given`: top-level fields already built), validated by msgspec."""
    tree: dict[str, Any] = {}
    for path, field in leaves(cls):
        if path[0] in given or not hasattr(args, field.name):
            continue
        node = tree
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = getattr(args, field.name)
    start = msgspec.to_builtins(base if base is not None else cls())
    merged = _merge(start, {**tree, **{k: msgspec.to_builtins(v) for k, v in given.items()}})
    return msgspec.convert(merged, type=cls, strict=False)


@functools.cache
def _paths(cls: type[msgspec.Struct]) -> dict[str, tuple[str, ...]]:
    """Each leaf's path by its name (a Struct class's fields do not change: computed once)."""
    return {path[-1]: path for path, _ in leaves(cls)}


def get_leaf(config: msgspec.Struct, name: str) -> Any:
    """The value of the leaf field `name` wherever it is nested in `config`."""
    value: Any = config
    for step in _paths(type(config))[name]:
        value = getattr(value, step)
    return value


def replace_leaves(config: S, **changes: Any) -> S:
    """`config` with leaf fields replaced by name, wherever each is nested
    (`replace_leaves(compare_config, tps=65.0, profile="local")`), validated and converted as
    decoding would (a list of names becomes a set of enum members); an unknown name raises."""
    paths = _paths(type(config))
    nested: dict[str, Any] = {}
    for name, value in changes.items():
        if name not in paths:
            raise TypeError(f"{type(config).__name__} has no field {name!r}")
        node = nested
        *inner, last = paths[name]
        for step in inner:
            node = node.setdefault(step, {})
        node[last] = value
    return msgspec.convert(msgspec.to_builtins(_replace(config, nested)), type(config))


def _replace(struct: S, changes: dict[str, Any]) -> S:
    fields = {
        name: _replace(getattr(struct, name), value) if isinstance(value, dict) else value
        for name, value in changes.items()
    }
    return msgspec.structs.replace(struct, **fields)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key in base:
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusal is one line on stderr, `PROG: argument --flag: why`, with
    exit code 2 (argparse's usage block before it is left out: `--help` prints it)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


_AT = re.compile(r"^(?P<why>.*) - at `\$(?P<path>(?:\.\w+)+)(?P<index>(?:\[\d+\])*)`$")


def option_error(exc: msgspec.ValidationError, cls: type[msgspec.Struct], flags: dict[str, str] | None = None) -> str:
    """msgspec's refusal of a config built from options, named by the flag that set the field:
    `Expected `int` >= 1 - at `$.rollouts`` is `--rollouts: Expected `int` >= 1`. `flags` maps a
    path (`base.rollouts`) to a flag where the options are not `cls`'s leaves (a sweep's)."""
    text = str(exc)
    found = _AT.match(text)
    if found is None:
        return text
    path = tuple(found["path"].split(".")[1:])
    flag = (flags or {}).get(".".join(path))
    if flag is None:
        flag = next((flag_of(field) for at, field in leaves(cls) if at == path), None)
    if flag is None:
        return text
    index = f" (item {int(found['index'][1:].split(']')[0]) + 1})" if found["index"] else ""
    return f"{flag}{index}: {found['why']}"
