"""Tests of shardcore: tests/engine."""
