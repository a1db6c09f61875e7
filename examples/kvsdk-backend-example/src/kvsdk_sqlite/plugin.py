"""The plugin module named by this package's ``kvsdk`` entry point."""

from __future__ import annotations

from kvsdk.hooks import hookimpl

from kvsdk_sqlite.backend import SQLiteBackend


@hookimpl
def kvsdk_backends() -> dict[str, type[SQLiteBackend]]:
    return {"sqlite": SQLiteBackend}
