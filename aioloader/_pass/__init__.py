"""A pass: one iteration over (the rest of) an epoch, in one event loop.

`pipeline` runs its stages (feed, decode stage, hand-over, watchdog), `feeds` reads its raw
items (a planned order, or a stream), `handover` gives batches over in order, `budget` is the
one memory account, `autotune` the read limit, and `factory` builds a pass from a configuration
(for a Loader, a loader service and a node's service alike).
"""
