"""Tests of shardcore: plugins/hyperparallel/tests."""
