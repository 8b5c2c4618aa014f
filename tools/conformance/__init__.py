"""The mpx conformance suite: shared cases, one adapter per backend, a runner and reports.

Cases are data (:mod:`conformance.cases`) whose expectations come from the mpx
core.  Each backend runs them in its own process (:mod:`conformance.worker`),
natively (the framework's own mixed-precision machinery and defaults) and under
mpx; :mod:`conformance.runner` collects the results and :mod:`conformance.report`
writes ``report.json``, ``report.md`` and ``report.html``.
"""
