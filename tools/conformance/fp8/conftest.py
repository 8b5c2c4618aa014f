# The fp8 group's backend modules import their frameworks; pytest (--doctest-modules) must not import
# them all into one process: the workers load each in its own (conformance/test_conformance.py's rule).
collect_ignore = ["torch.py", "tf.py", "jax.py", "keras.py"]
