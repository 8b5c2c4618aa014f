"""pytest (doctests of mpx_torch): keep DeepSpeed's accelerator line out of the examples' output.

Where DeepSpeed is installed, the Trainer and Accelerate examples import it (Accelerate's
``extract_model_from_parallel`` looks for ``DeepSpeedEngine``); on a machine with no accelerator
its auto-detection logs "Setting accelerator to CPU ..." to stdout, which a doctest reads as output.
There it would pick the CPU accelerator anyway: naming it (``DS_ACCELERATOR=cpu``) picks the same
one without the line.  With an accelerator, or a ``DS_ACCELERATOR`` already set, nothing changes.
"""

import os

import torch

if "DS_ACCELERATOR" not in os.environ and not torch.accelerator.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"
