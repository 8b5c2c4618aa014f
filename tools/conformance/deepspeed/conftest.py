# The deepspeed group's backend module imports torch (and deepspeed natively): the workers load it in its own
# process (conformance/test_conformance.py's rule).
collect_ignore = ["torch.py"]
