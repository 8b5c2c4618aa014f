"""pytest: the backend workers import their framework at import time; they run only as subprocesses."""

collect_ignore_glob = ["workers/torch.py", "workers/tf.py", "workers/jax.py"]
