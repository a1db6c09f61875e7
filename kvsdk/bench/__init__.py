"""``kvsdk bench core``: the core alone on a synthetic trace (no engine)."""
