"""The engine: backend discovery, group creation and the live-world checks (imports torch lazily, on use)."""
