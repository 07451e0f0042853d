"""Tests of shardcore: tests/megatron."""
