"""mmsparse: block-sparse multimodal attention with exact masks, forward and backward, in Triton.

On a machine without CUDA, importing mmsparse turns on Triton's CPU interpreter (TRITON_INTERPRET=1) unless the
variable is already set, so the same kernels run on CPU tensors. Import mmsparse before triton for that to apply.
"""

import os
import sys

import torch

# Only before triton is imported: turning the interpreter on afterwards leaves triton half-configured (the
# check in mbs_attention then reports that the interpreter is off, with the fix).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from .functional import interpreter_active, mbs_attention, mbs_attention_varlen  # noqa: E402
from .module import TritonMBSAttnKernel  # noqa: E402
from .reference import reference_attention, reference_mask  # noqa: E402
from .topology import Topology, generate_interlaced_mask  # noqa: E402

__all__ = [
    "Topology",
    "TritonMBSAttnKernel",
    "generate_interlaced_mask",
    "interpreter_active",
    "mbs_attention",
    "mbs_attention_varlen",
    "reference_attention",
    "reference_mask",
]
__version__ = "0.1.0"
