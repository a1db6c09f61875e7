"""vLLM adapter (``KVSDKConnector``); lands with its issue."""
