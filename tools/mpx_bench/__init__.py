"""``mpx bench`` and ``mpx doctor``: measured speed, memory and overhead of mpx against each framework's AMP.

The runner (:mod:`mpx_bench.bench`) and the reports never import a framework;
each backend is timed by ``python -m mpx_bench.worker BACKEND`` in its own
process (:mod:`mpx_bench.workers`).
"""

from mpx_bench.bench import FORMAT

__all__ = ["FORMAT"]
