"""The torch side of shardcore: executing what the pure-Python core plans."""
