"""The conformance group ``deepspeed`` (issue 32, item 2): DeepSpeed's own loss scalers on the scaler cases.

:mod:`conformance.deepspeed.cases` builds the cases (overflow sequences, each judged against three rules
computed by the core: mpx's DeepSpeed mode, mpx's default rule, torch's ``GradScaler`` rule) and names
what a native divergence is; :mod:`conformance.deepspeed.torch` runs them in the ``torch`` column:
natively deepspeed's ``DynamicLossScaler`` (what its ZeRO optimizers scale with) or its non-ZeRO
``FP16_Optimizer`` (real float16 steps on CPU), under mpx ``mpx_torch.GradScaler`` with the rule's config.

This module imports nothing (the native worker imports the package with mpx blocked).
"""

#: The reason a native case gives when deepspeed cannot be imported (the README's main command installs it).
NOT_INSTALLED = ("deepspeed is not installed: pip install --no-deps -c ci/constraints.txt deepspeed hjson "
                 "einops py-cpuinfo ninja (its packaging pulls a CUDA torch without --no-deps)")  # fmt: skip
