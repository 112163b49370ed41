"""Recurrent ops: RNN, GRU and LSTM with ONNX's full semantics, as differentiable torch code.

Every attribute and optional input of the ONNX operators is implemented: the
three directions, ``layout`` 0 (time-major) and 1 (batch-major, opset 14), the
optional inputs ``B``, ``sequence_lens``, ``initial_h``, ``initial_c`` and ``P``
(peepholes), ``activations`` with their ``activation_alpha``/``activation_beta``,
``clip``, ``input_forget`` (LSTM) and ``linear_before_reset`` (GRU), and each of
the outputs ``Y``, ``Y_h`` (and ``Y_c``) optional.

How the rules compute:

* The input projection ``X @ W^T + biases`` of all time steps is one matrix
  product per direction; only the recurrence ``H @ R^T`` runs in the per-step
  Python loop. Outputs are built with ``torch.stack`` and nothing autograd needs
  is written in place, so the rules train like any other.
* ``sequence_lens`` is applied with masks, never by reading lengths into Python:
  a step past a sequence's end keeps its state (so ``Y_h``/``Y_c`` hold the
  state at the last valid step) and writes zeros to ``Y``; the reverse
  direction reverses each sequence within its own length (a gather). Nothing
  depends on input *values* in Python, so a TorchScript trace of a pipelined
  stage (:mod:`placement.runtime.torch.traced`, keyed by input shapes)
  replays correctly for every input with the shapes it was recorded for.
* Fast path: an instance whose semantics are exactly torch's (default
  activations, no ``clip``, peepholes, ``input_forget`` or ``sequence_lens``;
  for GRU ``linear_before_reset=1``; for RNN activation Tanh or Relu) runs
  torch's fused kernels (``torch._VF.lstm``/``gru``/``rnn_tanh``/``rnn_relu``)
  with the gates reordered from ONNX's order (LSTM ``iofc``, GRU ``zrh``) to
  torch's (``ifgo``, ``rzn``). The loop is the reference; tests check both
  against ONNX's reference implementation and ONNX Runtime.

ONNX gives activations per direction (``[f, g, h]`` for LSTM, twice when
bidirectional); ``activation_alpha``/``activation_beta`` are consumed in that
order by the activations that take them (as ONNX Runtime does), others keep
their ONNX operator's default (``LeakyRelu`` 0.01, ``HardSigmoid`` 0.2/0.5,
``Elu`` 1.0).

Example:
    >>> import torch
    >>> from placement.lowering.ops import RULES
    >>> x = torch.randn(5, 2, 3)                       # (seq, batch, input)
    >>> w, r = torch.randn(1, 16, 3), torch.randn(1, 16, 4)  # 4 gates (iofc) x hidden 4
    >>> y, y_h, y_c = RULES["LSTM"].fn(x, w, r, num_outputs=3)
    >>> y.shape, y_h.shape, torch.equal(y[-1], y_h)
    (torch.Size([5, 1, 2, 4]), torch.Size([1, 2, 4]), True)
    >>> lens = torch.tensor([5, 2])                    # the second sequence ends after 2 steps
    >>> y, y_h = RULES["GRU"].fn(x, torch.randn(1, 12, 3), torch.randn(1, 12, 4), None, lens,
    ...                          linear_before_reset=1, num_outputs=2)
    >>> bool((y[2:, 0, 1] == 0).all()), torch.equal(y_h[0, 1], y[1, 0, 1])
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op

Activation = Callable[[Tensor], Tensor]

#: Activation (lower case) -> (takes alpha, takes beta, default alpha, default beta).
_ACTIVATION_ARGS: dict[str, tuple[bool, bool, float, float]] = {
    "relu": (False, False, 0.0, 0.0),
    "tanh": (False, False, 0.0, 0.0),
    "sigmoid": (False, False, 0.0, 0.0),
    "affine": (True, True, 0.0, 0.0),
    "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 0.0, 0.0),
    "scaledtanh": (True, True, 0.0, 0.0),
    "hardsigmoid": (True, True, 0.2, 0.5),
    "elu": (True, False, 1.0, 0.0),
    "softsign": (False, False, 0.0, 0.0),
    "softplus": (False, False, 0.0, 0.0),
}

#: Default activations per direction, and how many an op takes.
_DEFAULTS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DIRECTIONS = ("forward", "reverse", "bidirectional")


def _make_activation(name: str, alpha: float, beta: float) -> Activation:
    kind = name.lower()
    if kind == "relu":
        return torch.relu
    if kind == "tanh":
        return torch.tanh
    if kind == "sigmoid":
        return torch.sigmoid
    if kind == "affine":
        return lambda x: x * alpha + beta
    if kind == "leakyrelu":
        return lambda x: F.leaky_relu(x, alpha)
    if kind == "thresholdedrelu":
        return lambda x: torch.where(x > alpha, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if kind == "scaledtanh":
        return lambda x: torch.tanh(x * beta) * alpha
    if kind == "hardsigmoid":
        return lambda x: torch.clamp(x * alpha + beta, 0.0, 1.0)
    if kind == "elu":
        return lambda x: F.elu(x, alpha)
    if kind == "softsign":
        return F.softsign
    if kind == "softplus":
        return lambda x: torch.logaddexp(x, torch.zeros((), dtype=x.dtype, device=x.device))
    raise LoweringError(f"activation {name!r} is not one ONNX recurrent ops define")


def _activations(
    op_type: str,
    directions: int,
    names: Sequence[str] | None,
    alphas: Sequence[float] | None,
    betas: Sequence[float] | None,
) -> list[list[Activation]]:
    """The activation functions of each direction, alpha/beta consumed in order."""
    per = len(_DEFAULTS[op_type])
    listed = list(names) if names else list(_DEFAULTS[op_type]) * directions
    if len(listed) != per * directions:
        raise LoweringError(
            f"{op_type}: {len(listed)} activations for {directions} direction(s), "
            f"expected {per} per direction"
        )
    unknown = [n for n in listed if n.lower() not in _ACTIVATION_ARGS]
    if unknown:
        raise LoweringError(f"{op_type}: activations {unknown} are not ones ONNX recurrent ops define")
    alpha_iter, beta_iter = iter(alphas or ()), iter(betas or ())
    made: list[Activation] = []
    for name in listed:
        takes_alpha, takes_beta, alpha, beta = _ACTIVATION_ARGS[name.lower()]
        alpha = next(alpha_iter, alpha) if takes_alpha else alpha
        beta = next(beta_iter, beta) if takes_beta else beta
        made.append(_make_activation(name, float(alpha), float(beta)))
    return [made[d * per : (d + 1) * per] for d in range(directions)]


def _check(op_type: str) -> Callable[[dict[str, Any]], str | None]:
    def check(attrs: dict[str, Any]) -> str | None:
        direction = attrs.get("direction", "forward")
        if direction not in _DIRECTIONS:
            return f"direction={direction!r}"
        names = attrs.get("activations")
        if names:
            unknown = [n for n in names if n.lower() not in _ACTIVATION_ARGS]
            if unknown:
                return f"activations {unknown} (known: {', '.join(_ACTIVATION_ARGS)})"
            per = len(_DEFAULTS[op_type])
            if len(names) != per * (2 if direction == "bidirectional" else 1):
                return f"{len(names)} activations for direction={direction!r} (expected {per} per direction)"
        if attrs.get("layout", 0) not in (0, 1):
            return f"layout={attrs['layout']}"
        return None

    return check


def _flip(x: Tensor, index: Tensor | None) -> Tensor:
    """Reverse the time axis (0), per sequence within its length when ``index`` is given."""
    if index is None:
        return x.flip(0)
    return x.gather(0, index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(x.shape))


def _clipped(clip: float | None) -> Callable[[Tensor], Tensor]:
    if clip is None:
        return lambda x: x
    bound = float(clip)
    return lambda x: torch.clamp(x, -bound, bound)


# --- one direction, one op type ------------------------------------------------------


def _run(
    step: Callable[[Tensor, tuple[Tensor, ...]], tuple[Tensor, ...]],
    xw: Tensor,
    states: tuple[Tensor, ...],
    valid: Tensor | None,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Run ``step`` over the precomputed input projections ``xw`` (time first).

    ``step(xw_t, states) -> new states`` (the hidden state first). With ``valid``
    (time x batch booleans), invalid steps keep the old states and output zeros.
    """
    outputs: list[Tensor] = []
    for t in range(xw.shape[0]):
        new = step(xw[t], states)
        if valid is not None:
            keep = valid[t].unsqueeze(-1)
            new = tuple(torch.where(keep, n, s) for n, s in zip(new, states))
            outputs.append(torch.where(keep, new[0], torch.zeros((), dtype=xw.dtype, device=xw.device)))
        else:
            outputs.append(new[0])
        states = new
    if not outputs:
        return xw.new_zeros((0,) + states[0].shape), states
    return torch.stack(outputs), states


def _rnn_step(R: Tensor, act: list[Activation], clip: Callable[[Tensor], Tensor]) -> Callable[..., Any]:
    f = act[0]

    def step(xw: Tensor, states: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (f(clip(xw + states[0] @ R.t())),)

    return step


def _gru_step(
    R: Tensor, rb_h: Tensor | None, act: list[Activation], clip: Callable[[Tensor], Tensor], linear: bool
) -> Callable[..., Any]:
    f, g = act
    size = R.shape[-1]
    r_zr, r_h = R[: 2 * size], R[2 * size :]

    def step(xw: Tensor, states: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        h = states[0]
        x_zr, x_h = xw[:, : 2 * size], xw[:, 2 * size :]
        if linear:
            recurrent = h @ R.t()
            if rb_h is not None:
                recurrent = recurrent + rb_h
            z, r = f(clip(x_zr + recurrent[:, : 2 * size])).chunk(2, -1)
            candidate = g(clip(x_h + r * recurrent[:, 2 * size :]))
        else:
            z, r = f(clip(x_zr + h @ r_zr.t())).chunk(2, -1)
            candidate = g(clip(x_h + (r * h) @ r_h.t()))
        return ((1 - z) * candidate + z * h,)

    return step


def _lstm_cell(
    gates: Tensor,
    c: Tensor,
    peephole: tuple[Tensor | None, Tensor | None, Tensor | None],
    bias: Tensor | None,
    act: list[Activation],
    clip: Callable[[Tensor], Tensor],
    input_forget: bool,
) -> tuple[Tensor, Tensor]:
    """One LSTM step from the summed products ``gates`` (``iofc``) and the cell ``c``:
    peephole terms, then ``bias`` when given, ``clip`` and the activations; ``(H, C)``."""
    f, g, h_act = act
    p_i, p_o, p_f = peephole
    i, o, fg, cell = gates.chunk(4, -1)
    if p_i is not None:
        i = i + p_i * c
        fg = fg + p_f * c
    if bias is not None:
        b_i, b_o, b_f, b_c = bias.chunk(4)
        i, o, fg, cell = i + b_i, o + b_o, fg + b_f, cell + b_c
    i = f(clip(i))
    fg = 1 - i if input_forget else f(clip(fg))
    c_new = fg * c + i * g(clip(cell))
    if p_o is not None:
        o = o + p_o * c_new
    return f(clip(o)) * h_act(c_new), c_new


def _lstm_step(
    R: Tensor,
    P: Tensor | None,
    act: list[Activation],
    clip: Callable[[Tensor], Tensor],
    input_forget: bool,
) -> Callable[..., Any]:
    peephole = P.chunk(3) if P is not None else (None, None, None)

    def step(xw: Tensor, states: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        h, c = states
        return _lstm_cell(xw + h @ R.t(), c, peephole, None, act, clip, input_forget)

    return step


# --- the shared driver ----------------------------------------------------------------


def _recurrent(
    op_type: str,
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None,
    sequence_lens: Tensor | None,
    initial: list[Tensor | None],
    P: Tensor | None,
    attrs: dict[str, Any],
    num_outputs: int,
) -> Any:
    direction = attrs["direction"]
    if direction not in _DIRECTIONS:
        raise LoweringError(f"{op_type}: direction={direction!r} is not forward, reverse or bidirectional")
    layout = attrs["layout"]
    if layout:
        X = X.transpose(0, 1)
        initial = [s.transpose(0, 1) if s is not None else None for s in initial]
    dirs = 2 if direction == "bidirectional" else 1
    hidden_size = attrs["hidden_size"]
    if hidden_size is not None and int(hidden_size) != R.shape[-1]:
        raise LoweringError(f"{op_type}: hidden_size={hidden_size} but R has hidden size {R.shape[-1]}")
    if W.shape[0] != dirs:
        raise LoweringError(
            f"{op_type}: W has {W.shape[0]} direction(s), direction={direction!r} needs {dirs}"
        )
    fused = _fused_kernel(op_type, X, P, sequence_lens, attrs)
    if fused is not None:
        results = _run_fused(fused, X, W, R, B, initial, direction, op_type)
    else:
        results = _loop(op_type, X, W, R, B, sequence_lens, initial, P, attrs)
    if layout:
        results = [results[0].permute(2, 0, 1, 3)] + [s.transpose(0, 1) for s in results[1:]]
    return results[0] if num_outputs == 1 else tuple(results[:num_outputs])


def _loop(
    op_type: str,
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None,
    sequence_lens: Tensor | None,
    initial: list[Tensor | None],
    P: Tensor | None,
    attrs: dict[str, Any],
) -> list[Tensor]:
    """The reference: a Python loop over time steps, every attribute honoured (time-major)."""
    direction = attrs["direction"]
    dirs = W.shape[0]
    size = R.shape[-1]
    steps, batch = X.shape[0], X.shape[1]
    gates = _GATES[op_type] * size
    acts = _activations(
        op_type, dirs, attrs["activations"], attrs["activation_alpha"], attrs["activation_beta"]
    )
    clip = _clipped(attrs["clip"])
    valid = index = None
    if sequence_lens is not None:
        lens = sequence_lens.to(device=X.device, dtype=torch.int64).reshape(1, -1)
        time = torch.arange(steps, device=X.device).reshape(-1, 1)
        valid = time < lens
        index = torch.where(valid, lens - 1 - time, time)
    ys: list[Tensor] = []
    finals: list[tuple[Tensor, ...]] = []
    for d in range(dirs):
        w_bias = B[d, :gates] if B is not None else None
        r_bias = B[d, gates:] if B is not None else None
        x = X if (direction == "forward" or d == 0 and direction == "bidirectional") else _flip(X, index)
        reverse = x is not X
        xw = x @ W[d].t()
        states = tuple(s[d] if s is not None else X.new_zeros((batch, size)) for s in initial)
        linear = op_type == "GRU" and bool(attrs["linear_before_reset"])
        if w_bias is not None:
            xw = xw + w_bias
            if not linear:
                xw = xw + r_bias
        if op_type == "RNN":
            step = _rnn_step(R[d], acts[d], clip)
        elif op_type == "GRU":
            step = _gru_step(R[d], r_bias if linear else None, acts[d], clip, linear)
        else:
            peep = P[d] if P is not None else None
            step = _lstm_step(R[d], peep, acts[d], clip, bool(attrs["input_forget"]))
        y, final = _run(step, xw, states, valid)
        ys.append(_flip(y, index) if reverse else y)
        finals.append(final)
    Y = torch.stack(ys, 1)  # (seq, dirs, batch, hidden)
    return [Y] + [torch.stack([f[k] for f in finals]) for k in range(len(finals[0]))]


# --- the fast path: torch's fused kernels where their semantics are ONNX's -----------

#: Run eligible instances on torch's fused kernels (False: the reference loop everywhere).
USE_FUSED_KERNELS = True

#: ONNX gate order -> torch's (LSTM iofc -> ifgo, GRU zrh -> rzn).
_TORCH_GATES = {"RNN": [0], "GRU": [1, 0, 2], "LSTM": [0, 2, 3, 1]}
_FUSED_DTYPES = (torch.float32, torch.float64)


def _fused_kernel(
    op_type: str, X: Tensor, P: Tensor | None, sequence_lens: Tensor | None, attrs: dict[str, Any]
) -> Callable[..., Any] | None:
    """torch's fused kernel for this instance when it computes exactly ONNX's semantics, else None."""
    if not USE_FUSED_KERNELS:
        return None
    if sequence_lens is not None or P is not None or attrs["clip"] is not None or attrs["input_forget"]:
        return None
    if X.dtype not in _FUSED_DTYPES and X.device.type == "cpu":
        return None
    names = [n.lower() for n in attrs["activations"] or _DEFAULTS[op_type]]
    per = len(_DEFAULTS[op_type])
    if len(set(tuple(names[i : i + per]) for i in range(0, len(names), per))) != 1:
        return None  # directions with different activations
    first = tuple(names[:per])
    if op_type == "RNN":
        return {("tanh",): torch._VF.rnn_tanh, ("relu",): torch._VF.rnn_relu}.get(first)
    if first != tuple(n.lower() for n in _DEFAULTS[op_type]):
        return None
    if op_type == "GRU":
        return torch._VF.gru if attrs["linear_before_reset"] else None
    return torch._VF.lstm


def _torch_order(op_type: str, weight: Tensor) -> Tensor:
    """Rows of an ONNX gate-stacked weight or bias in torch's gate order."""
    gates = _TORCH_GATES[op_type]
    if len(gates) == 1:
        return weight
    chunks = weight.chunk(len(gates), 0)
    return torch.cat([chunks[g] for g in gates], 0)


def _run_fused(
    kernel: Callable[..., Any],
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None,
    initial: list[Tensor | None],
    direction: str,
    op_type: str,
) -> list[Tensor]:
    dirs, size = W.shape[0], R.shape[-1]
    gates = _GATES[op_type] * size
    params: list[Tensor] = []
    for d in range(dirs):
        params += [_torch_order(op_type, W[d]), _torch_order(op_type, R[d])]
        if B is not None:
            params += [_torch_order(op_type, B[d, :gates]), _torch_order(op_type, B[d, gates:])]
    states = [s if s is not None else X.new_zeros((dirs, X.shape[1], size)) for s in initial]
    x = X.flip(0) if direction == "reverse" else X
    hx: Any = states if op_type == "LSTM" else states[0]
    out = kernel(x, hx, params, B is not None, 1, 0.0, False, dirs == 2, False)
    y = out[0].flip(0) if direction == "reverse" else out[0]
    Y = y.reshape(y.shape[0], y.shape[1], dirs, size).transpose(1, 2)
    return [Y, *out[1:]]


_ATTRS = ("activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size", "layout")


def _attrs(values: dict[str, Any]) -> dict[str, Any]:
    """The recurrent attributes among a rule's arguments (``locals()``), with the defaults of
    those only GRU (``linear_before_reset``) and LSTM (``input_forget``) have."""
    picked = {k: values[k] for k in (*_ATTRS, "linear_before_reset", "input_forget") if k in values}
    return {"linear_before_reset": 0, "input_forget": 0, **picked}


@op("RNN", check=_check("RNN"))
def rnn(
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None = None,
    sequence_lens: Tensor | None = None,
    initial_h: Tensor | None = None,
    *,
    activation_alpha: Sequence[float] | None = None,
    activation_beta: Sequence[float] | None = None,
    activations: Sequence[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    num_outputs: int = 2,
) -> Any:
    """ONNX RNN: ``H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)``; outputs ``Y``, ``Y_h``."""
    attrs = _attrs(locals())
    return _recurrent("RNN", X, W, R, B, sequence_lens, [initial_h], None, attrs, num_outputs)


@op("GRU", check=_check("GRU"))
def gru(
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None = None,
    sequence_lens: Tensor | None = None,
    initial_h: Tensor | None = None,
    *,
    activation_alpha: Sequence[float] | None = None,
    activation_beta: Sequence[float] | None = None,
    activations: Sequence[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    linear_before_reset: int = 0,
    num_outputs: int = 2,
) -> Any:
    """ONNX GRU (gates ``zrh``): outputs ``Y``, ``Y_h``."""
    attrs = _attrs(locals())
    return _recurrent("GRU", X, W, R, B, sequence_lens, [initial_h], None, attrs, num_outputs)


@op("LSTM", check=_check("LSTM"))
def lstm(
    X: Tensor,
    W: Tensor,
    R: Tensor,
    B: Tensor | None = None,
    sequence_lens: Tensor | None = None,
    initial_h: Tensor | None = None,
    initial_c: Tensor | None = None,
    P: Tensor | None = None,
    *,
    activation_alpha: Sequence[float] | None = None,
    activation_beta: Sequence[float] | None = None,
    activations: Sequence[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    num_outputs: int = 3,
) -> Any:
    """ONNX LSTM (gates ``iofc``, peepholes ``iof``): outputs ``Y``, ``Y_h``, ``Y_c``."""
    attrs = _attrs(locals())
    return _recurrent("LSTM", X, W, R, B, sequence_lens, [initial_h, initial_c], P, attrs, num_outputs)
