"""What runs in a decode process: `decode` turns a chunk of raw items into a batch (written
into a shared block when one is lent), `serve` is the process's life once the zygote forked
it, and `preload` names what it imported (the zygote imports that before the next fork).
"""
