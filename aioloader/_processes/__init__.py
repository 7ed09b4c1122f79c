"""The processes aioloader starts: `zygote` (and `zygote_main`, its life) forks decode
processes and loader services from a small interpreter, `pool` keeps a pass's decode
processes.
"""
