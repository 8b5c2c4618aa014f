"""pytest: a backend's models module imports its framework at import time; the suite that collects this
package imports none (its tests start the frameworks in processes of their own)."""

collect_ignore_glob = ["models/torch.py", "models/flax.py", "models/keras.py"]
