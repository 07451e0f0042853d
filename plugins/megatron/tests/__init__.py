"""Tests of shardcore: plugins/megatron/tests."""
