"""One adapter per backend: ``info()``, ``run(kind, params, mode)``, ``save_state(config, flags)``.

Each adapter imports only its own framework and runs in its own process.
"""
