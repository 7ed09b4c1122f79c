"""`python -m aioloader._runtime.zygote_main`: the zygote process (see `zygote`); a module of
its own because the package imports `zygote`, and runpy warns about running such a module."""

from .zygote import main

main()
