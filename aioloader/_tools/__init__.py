"""The command line and its tools (demo, serve, bench, pack, inspect, timeline); private."""
