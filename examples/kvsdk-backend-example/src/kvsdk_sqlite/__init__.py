"""kvsdk-backend-sqlite: a kvsdk storage backend keeping chunks in one SQLite file.

Installed, it registers the backend ``sqlite`` through the ``kvsdk`` entry point
(see :mod:`kvsdk_sqlite.plugin`); users select it in YAML::

    tiers:
      - {backend: cpu, capacity: 8GiB}
      - {backend: sqlite, path: /var/cache/kvsdk/chunks.db, capacity: 100GiB}
"""

from kvsdk_sqlite.backend import SQLiteBackend, SQLiteOptions

__all__ = ["SQLiteBackend", "SQLiteOptions"]
__version__ = "0.1.0"
