"""Where a pass's chunks are decoded, in the main process's (or the service's) event loop:
`decoders` inline, on the decode pool, or shared by a node's ranks, with the recovery rules;
`remote` on an executor or a cluster (`on_executor`, `on_dask`, `on_ray`).
"""
