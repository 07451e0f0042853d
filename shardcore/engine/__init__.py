"""The engine: backend discovery, group creation, refit execution and the live checks (torch imported on use)."""
