"""Test stand-in: the current layout's home of MeshContext and DistributedSetup."""
