"""One adapter per backend: ``info()``, ``run_KIND(params, mode)`` per case kind, ``save_state(config, flags)``.

Each adapter imports only its own framework and runs in its own process.
"""
