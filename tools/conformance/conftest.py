# The adapters import their frameworks; pytest must not import them all into one process.
collect_ignore = ["adapters"]
