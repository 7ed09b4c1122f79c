"""What crosses a process boundary: `channel` frames pickles on a socket, `messages` are the
decode channel's, `shm` names and maps shared-memory segments, `transport` lends blocks and
hands batches over as views of them.
"""
