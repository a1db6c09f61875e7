"""The configuration reference (Markdown), generated from the schema itself:
every option of the top level and of each installed backend, with its type,
default and the docstring written under it in the source."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from kvsdk import config, plugins_manager


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right after a field) of a dataclass."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_text(tp: Any, meta: Any) -> str:
    if meta.get("unit") == "bytes":
        return "size (`512MiB`, `8GiB`, bytes)"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin is tuple and typing.get_args(tp)[:1] == (tuple[str, float],):
        return "mapping of tenant to share"
    return config._type_name(tp).removeprefix("an ").removeprefix("a ")


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default == ():
        return "none"
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(see below)" if dataclasses.is_dataclass(value) else f"`{value!r}`"
    return "**required**"


def _table(cls: type, prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    nested: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            nested.append((f"{prefix}{f.name}", tp))
            rows.append(f"| `{prefix}{f.name}` | mapping | (see below) | {docs.get(f.name, '')} |")
            continue
        rows.append(
            f"| `{prefix}{f.name}` | {_type_text(tp, f.metadata)} | {_default_text(f)} "
            f"| {docs.get(f.name, '')} |"
        )
    out = rows
    for name, sub in nested:
        out += ["", f"### `{name}`", "", *_table(sub, f"{name}.")]
    return out


def reference_markdown() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from kvsdk's schema by `kvsdk config reference`; do not edit by hand.",
        "Validate a file with `kvsdk config check FILE`; export the JSON Schema for your",
        "editor with `kvsdk config schema -o kvsdk.schema.json`.",
        "",
        "Every value is checked when the config is read, before anything starts: sizes",
        "(`512MiB`, `8GiB`) are at most 1 EiB, integers fit 64 bits,",
        "numbers are finite (`.nan` and `.inf` are refused), a deployment secret is",
        "read and checked (see docs/security.md). A problem is one sentence naming the",
        "key (exit 2); the value of a credential (`password`, `token`, ...) is never shown.",
        "",
        "## Top level",
        "",
        *_table(config.KVSDKConfig, "", skip=("tiers",)),
        "",
        "## `tiers`",
        "",
        "A list; each item is a mapping with `backend:` (an installed backend) and that",
        "backend's options. The first tier must be host memory (`cpu`); stores go to it and",
        "are written through to the next ones; a hit in a slower tier is promoted first.",
        "Built-in backends are listed here; `kvsdk plugins` lists installed third-party ones.",
        "",
    ]
    builtin = {
        n: c
        for n, c in plugins_manager.backends().items()
        if c.__module__.startswith("kvsdk.backends.")
    }
    for name, cls in sorted(builtin.items()):
        doc = (inspect.getdoc(inspect.getmodule(cls)) or "").split("\n\n")[0]
        lines += [
            f"### `backend: {name}`",
            "",
            " ".join(doc.split()),
            "",
            *_table(cls.Options, ""),
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"
