"""The runtime: passes, the decode pool, shared memory; private."""
