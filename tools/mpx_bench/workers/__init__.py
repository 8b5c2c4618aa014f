"""One module per backend, each imported only in its own worker process.

Each module has ``info(device) -> dict``, ``compute_dtype(policy) -> str``,
``probe(dtypes, budget_s, device) -> dict`` and
``configs(model, size, policies, device, slow) -> list[mpx_bench.harness.Config]``.
"""
