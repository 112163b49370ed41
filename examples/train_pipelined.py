"""Train a placed model through the pipelined torch lowering, then serve it with ONNX Runtime.

A GPT from the zoo is exported with a dynamic batch, placed on two logical
devices by ``pl.auto_place``, lowered with ``pl.to_torch(chunks=4)`` and
trained for a few steps with ``torch.optim.Adam`` on next-token prediction.
Each step is ``module.train_step``: micro-batches flow through the two stages
concurrently, each one's loss computed on the last stage as soon as its forward
ends and back-propagated at once (1F1B, weight gradients deferred to fill idle
time); the gradients are those of ``loss.backward()`` on the whole batch. The
trained weights go back into the placed graph (``model.update_parameters``),
the graph is saved as placed ONNX, loaded again and run with
``pl.Runner(chunks=4)``: its outputs equal the trained module's.

Run::

    python examples/train_pipelined.py [--size tiny|bench] [--steps 20] [--chunks 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from placement.models import gpt  # noqa: E402


def train(
    *, size: str = "tiny", steps: int = 20, chunks: int = 4, out: Path | None = None
) -> dict[str, float]:
    """Train, save, reload and serve; returns the first and last loss and the ORT/torch difference."""
    torch.manual_seed(0)
    net, (idx,) = gpt.build(size)
    batch = torch.export.Dim("batch")
    model = pl.from_torch(net, (idx,), dynamic_shapes=({0: batch},))
    pl.auto_place(model, devices=2, cost="size")
    pl.inject_cross_device_copies(model)

    module = pl.to_torch(model, device_map="cpu", chunks=chunks, checkpoint="except_last")
    module.train()
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    vocab = net.config.vocab_size
    data = torch.randint(0, vocab, (4 * chunks, idx.shape[1] + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = data[:, :-1], data[:, 1:]

    def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = module.train_step(inputs, loss_fn=next_token_loss, targets=(targets,))
        optimizer.step()
        losses.append(loss.item())

    model.update_parameters(module)
    folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="placement-train-"))
    path = folder / "trained_placed.onnx"
    model.save(path)
    served = pl.Runner(pl.load(path), device_map="cpu", chunks=chunks)
    (ort_logits,) = served.run([inputs])
    with torch.no_grad():
        torch_logits = module(inputs).numpy()
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "max_abs_diff": float(np.abs(ort_logits - torch_logits).max()),
        "path": str(path),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "bench"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = train(size=args.size, steps=args.steps, chunks=args.chunks, out=args.out)
    print(f"loss {result['first_loss']:.4f} -> {result['last_loss']:.4f} over {args.steps} steps")
    print(
        f"saved {result['path']}; ONNX Runtime vs trained module: max |diff| = {result['max_abs_diff']:.2e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
