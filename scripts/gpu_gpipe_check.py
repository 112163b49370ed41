"""GPipe and 1F1B on two logical devices of one GPU (and on two GPUs where there are two):
outputs, loss and gradients against eager within the tolerance of the precision in force.

Run by ``scripts/gpu-acceptance.sh``; exits 0 with a message where torch sees no GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import placement as pl  # noqa: E402
from placement.models import gpt  # noqa: E402
from placement.runtime.precision import tolerance, torch_precision  # noqa: E402


def check(device_map: dict[int, str], *, chunks: int = 4, size: str = "bench") -> None:
    """``gpt`` (``size``) placed in two halves, on ``device_map``: checked as the module says."""
    net, (idx,) = gpt.build(size)
    idx = torch.cat([idx] * 4)[:8]
    model = pl.from_torch(net, (idx,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    model = pl.place_evenly(model, 2)
    device = torch.device(device_map[0])
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    tol = tolerance("fp32", on_gpu=on_gpu)
    with torch_precision("fp32"):
        net = net.to(device)
        x = idx.to(device)
        module = pl.to_torch(model, device_map=device_map, chunks=chunks)
        with torch.no_grad():
            want, got = net(x), module(x)
        sync()
        torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)
        target = torch.randn_like(want)
        loss = module.train_step(x, loss_fn=torch.nn.functional.mse_loss, targets=(target,))
        ref = torch.nn.functional.mse_loss(net(x), target)
        names = [name for name, _ in net.named_parameters()]
        grads = dict(zip(names, torch.autograd.grad(ref, list(net.parameters()))))
        sync()
        torch.testing.assert_close(loss, ref.detach(), rtol=tol.rtol, atol=tol.atol)
        ours = dict(module.named_parameters())
        pairs = {name: name for name in grads if name in ours}
        for name in set(grads) - set(pairs):  # a tied weight, named after its other user here
            shape = net.get_parameter(name).shape
            pairs[name] = next(n for n, p in ours.items() if n not in grads and p.shape == shape)
        for name, mine in pairs.items():
            close = {"rtol": 10 * tol.rtol, "atol": 10 * tol.atol}
            torch.testing.assert_close(ours[mine].grad, grads[name], **close, msg=name)
    runner = pl.Runner(model, device_map=device_map, chunks=chunks, fold=False)
    wanted = "CUDAExecutionProvider" if on_gpu else "CPUExecutionProvider"
    assert set(runner.stats.providers.values()) == {wanted}, runner.summary()
    (out,) = runner.run([x], outputs="torch")
    torch.testing.assert_close(out, want, rtol=runner.tolerance.rtol, atol=runner.tolerance.atol)
    print(
        f"gpipe-check: {device_map}, chunks={chunks}: torch forward, 1F1B step, ORT run match eager ({tol})"
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("gpipe-check: no CUDA GPU here: skipped")
        return 0
    check({0: "cuda:0", 1: "cuda:0"})
    if torch.cuda.device_count() > 1:
        check({0: "cuda:0", 1: "cuda:1"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
