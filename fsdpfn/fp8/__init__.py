"""FP8 parameters: an MXFP8 (or per-tensor, or 1 x 128 block) all-gather of the weights, with
fp32 masters, straight-through gradients and an optional hand-over to Transformer Engine.

Pure torch: recipes quantize and dequantize plain tensors (E4M3 elements, E8M0 or float32
scales, round to nearest even), so they run and are tested on CPU. Turn the gather on with
``fsdpfn.MixedPrecision(..., fp8="mxfp8")`` or a :class:`Float8GatherPolicy`.

Example:
  >>> r = fsdpfn.fp8.MXFP8BlockScaling()
  >>> q = r.quantize(torch.linspace(-1, 1, 40).reshape(1, 40))
  >>> q.data.dtype, q.scale.tolist()          # 2 blocks along the last dim: 32 + 8 (padded)
  (torch.float8_e4m3fn, [[119, 119]])
  >>> (r.dequantize(q) - torch.linspace(-1, 1, 40)).abs().max() < 2**-5
  tensor(True)
"""

from fsdpfn.fp8._codec import ByteSlot as ByteSlot
from fsdpfn.fp8._codec import Float8Codec as Float8Codec
from fsdpfn.fp8._codec import Float8Layout as Float8Layout
from fsdpfn.fp8._codec import float8_layout as float8_layout
from fsdpfn.fp8._fake import fake_quantize as fake_quantize
from fsdpfn.fp8._policy import BACKENDS as BACKENDS
from fsdpfn.fp8._policy import Float8GatherPolicy as Float8GatherPolicy
from fsdpfn.fp8._policy import as_gather_policy as as_gather_policy
from fsdpfn.fp8._recipes import Float8BlockScaling as Float8BlockScaling
from fsdpfn.fp8._recipes import Float8CurrentScaling as Float8CurrentScaling
from fsdpfn.fp8._recipes import Float8Recipe as Float8Recipe
from fsdpfn.fp8._recipes import MXFP8BlockScaling as MXFP8BlockScaling
from fsdpfn.fp8._recipes import Quantized as Quantized
from fsdpfn.fp8._recipes import recipe_from_dict as recipe_from_dict
from fsdpfn.fp8._te import check_te as check_te
from fsdpfn.fp8._te import te_tensor as te_tensor

__all__ = [
    "BACKENDS",
    "ByteSlot",
    "Float8BlockScaling",
    "Float8Codec",
    "Float8CurrentScaling",
    "Float8GatherPolicy",
    "Float8Layout",
    "Float8Recipe",
    "MXFP8BlockScaling",
    "Quantized",
    "as_gather_policy",
    "check_te",
    "fake_quantize",
    "float8_layout",
    "recipe_from_dict",
    "te_tensor",
]
