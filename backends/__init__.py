"""kvsdk's built-in storage backends (``kvsdk.backends.*``), one module each."""
