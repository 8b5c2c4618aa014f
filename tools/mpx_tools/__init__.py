"""What the mpx tools share, so that no tool imports another's modules.

The tools (``conformance``, ``mpx_bench``, ``mpx_compare``) sit side by side above the library
(``mpx``, ``mpx_torch``, ``mpx_keras``, ``mpx_tf``, ``mpx_jax``); each imports the library, third
parties and this package, never another tool.  Here:

- :mod:`mpx_tools.workers`: the backend names, the worker environment and launcher, the JSON-lines
  writer of a worker, the progress line;
- :mod:`mpx_tools.command`: the object each tool registers as an ``mpx.commands`` entry point;
- :mod:`mpx_tools.reports`: the text and Markdown tables, the charts' matplotlib setup and the report
  files of ``mpx bench`` and ``mpx compare``;
- :mod:`mpx_tools.machine`: what the machine is (CPU, cores, precision flags, load);
- :mod:`mpx_tools.skip`: :class:`~mpx_tools.skip.Skip`, a case or configuration that does not apply;
- :mod:`mpx_tools.models`: the Hugging Face models of the conformance ``models`` group, which
  ``mpx bench`` times too.

Importing this package imports nothing; ``workers``, ``skip``, ``reports``, ``machine`` and
``models`` import nothing of mpx at module level (a native conformance worker, where mpx is
blocked, imports them).
"""
