"""``mpx compare``: does mixed precision train as well as float32? Per backend, over seeds, on real data.

The driver (:mod:`mpx_compare.engine`) and the reports import no framework;
each backend's runs happen in :mod:`mpx_compare.workers` (``torch``, ``tf``,
``jax``), in their own process for the command, or in this process through
:func:`mpx_compare.compare` for your own model and data::

    import mpx_compare
    result = mpx_compare.compare("torch", make_model, (x_train, y_train, x_val, y_val),
                                 policies=["mixed_bfloat16"], seeds=3, out="my-compare")
    result["summary"]   # per policy: accuracy, delta to float32, pass/fail, skipped steps, final scale
"""

from mpx_compare.engine import FORMAT, compare, run, summarize

__all__ = ["FORMAT", "compare", "run", "summarize"]
