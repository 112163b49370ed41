"""The ONNX -> torch op table: one :class:`Rule` per ONNX op type, one module per family.

In the style of JAX's per-primitive rule tables, :data:`RULES` maps an ONNX op
type (default domain) to a :class:`Rule` registered with :func:`op` next to its
torch implementation. The implementation takes the op's inputs positionally
(``None`` for an omitted optional input) and its attributes as keyword
arguments named exactly like the ONNX attributes, and returns a tensor (one
output) or a tuple of tensors (several outputs). Inputs are named like the ONNX
inputs, so an attribute that became an input in a later opset (``Squeeze(axes)``,
``Split(split)``, ``Reduce*(axes)``, ``Clip(min, max)``) works in both forms.
Op types without a rule get :data:`DEFAULT_RULE`, which raises
:class:`~placement.errors.LoweringError` naming the op.

The same registration carries the op type's flags: ``nondeterministic`` (random
ops, read from :data:`placement.analysis.NONDETERMINISTIC_OPS`: never folded),
whether torch lacks its unsigned kernels (``widen_unsigned``), and an optional
custom emitter (``emit``: ``MatMul`` + bias ``Add`` -> ``F.linear``, or the taken
branch of an ``If`` whose condition is known when lowering). FLOP costs, which the
planner needs below the runtime layer, are :mod:`placement.analysis.costs`.

A rule also declares how the lowering may feed it constants:

* ``shape_inputs``: positions of shape-like inputs (shapes, axes, pads, sizes,
  repeats). When such an input is a lowering-time constant it is passed as a
  Python int or list, so ``Reshape`` becomes ``reshape(x, [2, 8, 4, 8])`` and
  never syncs a GPU to read a shape. Rules accept tensors there too.
* ``scalar_inputs``: positions where a 0-d constant may be passed as a Python
  number (``x * 0.125`` instead of a 0-d buffer).
* ``buffer_inputs``: positions holding state rather than weights (BatchNorm's
  running statistics): initializers fed there become buffers, not parameters.

and, optionally, a ``direct`` emitter: for instances where plain torch has the
same semantics (``Transpose`` with ``perm`` -> ``x.permute(...)``, ``Gather`` on
axis 0 -> ``w[idx]``, ``Where(c, scalar, y)`` -> ``y.masked_fill(c, scalar)``),
the lowering emits that call instead of the rule. Rules are the reference; the
direct forms are checked against them by the same tests.

Families: :mod:`.elementwise`, :mod:`.linalg`, :mod:`.nn`, :mod:`.conv`, :mod:`.pooling`,
:mod:`.sampling` (Resize, GridSample), :mod:`.detection` (NonMaxSuppression, RoiAlign),
:mod:`.deform` (DeformConv), :mod:`.recurrent_state` (LinearAttention,
CausalConvWithState), :mod:`.optimizers` (the training domain's optimizer steps), :mod:`.text`
(TfIdfVectorizer), :mod:`.flex_attention` (FlexAttention with its subgraphs),
:mod:`.ml` (ai.onnx.ml Binarizer, ArrayFeatureExtractor), :mod:`.trees` (ai.onnx.ml tree
ensembles), :mod:`.shape`,
:mod:`.reduction`, :mod:`.random`, :mod:`.attention`, :mod:`.recurrent`
(RNN, GRU, LSTM), :mod:`.quantized_recurrent` (ORT's DynamicQuantizeLSTM),
:mod:`.control`, :mod:`.quantized` (integer quantization, also ONNX
Runtime's ``com.microsoft`` quantized matmuls, keyed ``"com.microsoft::<op>"``), :mod:`.signal`
(DFT, STFT, windows), :mod:`.contrib` and :mod:`.contrib_attention` (ONNX Runtime's ops in
LLM files: ``SimplifiedLayerNormalization``, ``SkipSimplifiedLayerNormalization``,
``MatMulNBits``, ``RotaryEmbedding``, ``GroupQueryAttention``, ``MultiHeadAttention``).

Example:
    >>> import torch
    >>> from placement.lowering.ops import RULES
    >>> RULES["Gemm"].fn(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4), transB=1).shape
    torch.Size([2, 4])
    >>> RULES["Reshape"].fn(torch.zeros(2, 6), [0, -1, 3]).shape  # 0 copies the input dim
    torch.Size([2, 2, 3])
    >>> RULES["RandomNormal"].nondeterministic, RULES["Relu"].nondeterministic
    (True, False)
"""

from __future__ import annotations

from placement.lowering.ops import (
    attention,
    contrib,
    contrib_attention,
    control,
    conv,
    deform,
    detection,
    elementwise,
    flex_attention,
    linalg,
    ml,
    nn,
    optimizers,
    pooling,
    quantized,
    quantized_recurrent,
    random,
    recurrent,
    recurrent_state,
    reduction,
    sampling,
    shape,
    signal,
    text,
    trees,
)
from placement.lowering.ops._registry import (
    DEFAULT_RULE,
    RULES,
    Rule,
    get_rule,
    op,
    supported_op_types,
    torch_dtype,
)

__all__ = [
    "Rule",
    "RULES",
    "DEFAULT_RULE",
    "get_rule",
    "op",
    "supported_op_types",
    "torch_dtype",
    "attention",
    "contrib",
    "contrib_attention",
    "control",
    "conv",
    "deform",
    "detection",
    "elementwise",
    "flex_attention",
    "linalg",
    "ml",
    "nn",
    "optimizers",
    "pooling",
    "quantized",
    "quantized_recurrent",
    "random",
    "recurrent",
    "recurrent_state",
    "reduction",
    "sampling",
    "shape",
    "signal",
    "text",
    "trees",
]
