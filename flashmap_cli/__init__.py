"""The top layer: the `flashmap` command (generate, steps, up, eval) and the local stack
supervisor. It may import every part; no part imports it."""
