# The blocks group's backend modules import their frameworks: the workers load each in its own process.
collect_ignore = ["torch.py", "jax.py", "keras.py"]
