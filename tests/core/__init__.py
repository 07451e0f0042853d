"""Tests of shardcore: tests/core."""
