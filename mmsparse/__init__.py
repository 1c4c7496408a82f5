"""mmsparse: multimodal block-sparse (MBS) attention with exact masks, forward and backward, in Triton.

On a machine without CUDA, importing mmsparse turns on Triton's CPU interpreter (TRITON_INTERPRET=1) unless the
variable is already set, so the same kernels run on CPU tensors. That only works before triton is imported; if
something imported triton first (transformers' model classes do), ``import mmsparse`` raises an ImportError that
says how to fix it (import mmsparse first, or start Python with TRITON_INTERPRET=1).
"""

_TRUE = ("1", "true", "on", "yes", "y")  # what Triton reads as true


def _use_interpreter_without_cuda() -> None:
    """Without CUDA, turn on Triton's CPU interpreter, or fail now if that is no longer possible.

    Triton decides compiled or interpreted for each ``@triton.jit`` function when the function is created, reading
    TRITON_INTERPRET at that moment (``triton.jit`` checks ``knobs.runtime.interpret``, in 3.6 and 3.9 alike). Its
    own library functions (``tl.sum``, ``tl.max``, ``tl.cumsum``, ...) are created by ``import triton``, and an
    interpreted kernel cannot call a compiled ``tl.sum``. So once triton has been imported without the variable,
    no later setting gives kernels that run on the CPU: say so at import, with the fix, not at the first call.
    """
    import os  # here, not at the top: the package namespace holds its public API, not these modules
    import sys

    import torch

    if torch.cuda.is_available():
        return
    env = os.environ.get("TRITON_INTERPRET")
    if env is not None and env.strip().lower() not in _TRUE:
        return  # the user turned the interpreter off: CPU tensors then get a ValueError naming the variable
    standard = sys.modules.get("triton.language.standard")
    if standard is None or type(getattr(standard, "sum", None)).__name__ == "InterpretedFunction":
        os.environ["TRITON_INTERPRET"] = "1"  # triton's functions are not built yet, or built interpreted
        return
    raise ImportError(
        "mmsparse: there is no CUDA device, so its Triton kernels must run in Triton's CPU interpreter, but triton "
        "was imported before mmsparse without TRITON_INTERPRET=1 (importing a transformers model class imports "
        "it), and Triton fixes that choice for its own functions at import: setting the variable later is too late. "
        "Fix: import mmsparse before transformers/triton, or set the variable before Python starts: "
        "TRITON_INTERPRET=1 python your_script.py"
    )


_use_interpreter_without_cuda()

from . import tuning  # noqa: E402
from .attention.config import use_config  # noqa: E402
from .functional import clear_caches, mbs_attention, mbs_attention_varlen  # noqa: E402
from .mask.build import prepare_mask  # noqa: E402
from .mask.prepared import PreparedMask  # noqa: E402
from .mask.topology import CAUSAL, FULL, NONE, Topology, generate_interlaced_mask  # noqa: E402
from .picture import TileMap, tile_map, tile_picture  # noqa: E402
from .qkv_module import TritonMBSAttnKernel  # noqa: E402
from .recompute import checkpoint, settings_context_fn  # noqa: E402
from .reference import reference_attention, reference_mask, reference_packed_mask  # noqa: E402
from .runtime.launch import interpreter_active  # noqa: E402

__all__ = [
    "CAUSAL",
    "FULL",
    "NONE",
    "PreparedMask",
    "TileMap",
    "Topology",
    "TritonMBSAttnKernel",
    "checkpoint",
    "clear_caches",
    "generate_interlaced_mask",
    "interpreter_active",
    "mbs_attention",
    "mbs_attention_varlen",
    "prepare_mask",
    "reference_attention",
    "reference_mask",
    "reference_packed_mask",
    "settings_context_fn",
    "tile_map",
    "tile_picture",
    "tuning",
    "use_config",
]
__version__ = "0.2.0"

_MOVED_TO_TUNING = ("Tile", "KernelConfig")  # importable from here, with a DeprecationWarning, until the next release


def __getattr__(name: str) -> object:
    if name in _MOVED_TO_TUNING:
        import warnings  # here, not at the top: the package namespace holds its public API

        warnings.warn(f"mmsparse.{name} moved to mmsparse.tuning.{name} (tiles and thresholds are set with "
                      f"mmsparse.tuning.use_tuning); the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(tuning, name)
    raise AttributeError(f"module 'mmsparse' has no attribute {name!r}")
