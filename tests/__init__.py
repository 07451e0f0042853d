"""Tests of shardcore: tests."""
