"""Tests of shardcore: plugins/dtensor/tests."""
