"""pytest (doctests of mpx_jax): the slow-policy warning is tested in tests/jax/test_slow_warning.py."""

import os

os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")
