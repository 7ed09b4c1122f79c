"""How a Loader iterates: `runner` opens one pass at a time where the configuration says and
books where the Loader stands; `handles` drives a pass run here or in a loader service through
one interface, for `for` and `async for`.
"""
