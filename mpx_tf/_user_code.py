"""Moved to :mod:`mpx_keras._user_code` (the same rule on every Keras backend, #24).

``mpx_tf._user_code`` *is* that module (one module object under two names), so
``LIBRARY_PACKAGES``, ``MAX_TRACING_FRAMES`` and the caches read or changed
through either name are the same ones.
"""

import sys

from mpx_keras import _user_code

sys.modules[__name__] = _user_code
