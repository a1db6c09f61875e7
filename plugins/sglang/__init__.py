"""SGLang adapter (HiCache storage backend ``KVSDKStorage``); lands with its issue."""
