"""onnxruntime-genai's greedy decoding speed on a genai model folder: the anchor column.

onnxruntime-genai brings plain ``onnxruntime``, which must not share an environment
with the project's ``onnxruntime-gpu``, so genai runs in a Python of its own. This
file is both sides:

* run as a script with that Python, it times ``og.Generator`` (greedy, fixed prompt)
  and prints one JSON object;
* imported by a benchmark, :func:`genai_tokens_per_s` runs it through a subprocess with
  the Python named by ``PLACEMENT_GENAI_PYTHON``, or says why there is no genai column.

Usage::

    PLACEMENT_GENAI_PYTHON=/path/to/genai-venv/bin/python python -m benchmarks.genai_anchor \\
        tests/genai_files/llama_fp32 --prompt 8 --new-tokens 48 --batch 1
    /path/to/genai-venv/bin/python benchmarks/genai_anchor.py tests/genai_files/llama_fp32 --run

Example:
    >>> from benchmarks.genai_anchor import ENV, genai_tokens_per_s
    >>> ENV
    'PLACEMENT_GENAI_PYTHON'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV", "GenaiServer", "build_genai_model", "genai_tokens_per_s", "measure", "serve"]

#: The environment variable naming the Python of a venv with onnxruntime-genai.
ENV = "PLACEMENT_GENAI_PYTHON"


def genai_tokens_per_s(
    folder: str | os.PathLike[str],
    *,
    prompt: int = 8,
    new_tokens: int = 48,
    batch: int = 1,
    repeats: int = 5,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """genai's tokens/s on ``folder``, measured in the Python named by ``PLACEMENT_GENAI_PYTHON``.

    Returns the script's JSON (``tokens_per_s``, ``tokens``, versions...), or
    ``{"tokens_per_s": None, "reason": ...}`` when that Python is not set, missing or fails.
    """
    python = os.environ.get(ENV)
    if not python:
        return {
            "tokens_per_s": None,
            "reason": f"{ENV} is not set: no onnxruntime-genai column "
            "(point it at the Python of a venv with onnxruntime-genai)",
        }
    if not Path(python).exists():
        return {"tokens_per_s": None, "reason": f"{ENV}={python!r} does not exist"}
    cmd = [python, str(Path(__file__).resolve()), str(folder), "--run", "--prompt", str(prompt)]
    cmd += ["--new-tokens", str(new_tokens), "--batch", str(batch), "--repeats", str(repeats)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"tokens_per_s": None, "reason": f"onnxruntime-genai ran past {timeout:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"tokens_per_s": None, "reason": f"onnxruntime-genai failed: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(folder: str, *, prompt: int, new_tokens: int, batch: int, repeats: int) -> dict[str, Any]:
    """Time greedy ``og.Generator`` runs (inside the genai venv): the median of ``repeats``."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(folder)
    ids = (np.arange(batch * prompt, dtype=np.int64).reshape(batch, prompt) * 7 + 3) % 97 + 3

    def generate() -> list[list[int]]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=prompt + new_tokens, batch_size=batch)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        return [list(map(int, generator.get_sequence(b)))[prompt:] for b in range(batch)]

    tokens = generate()  # warm-up, and the tokens
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate()
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    return {
        "tokens_per_s": batch * new_tokens / median,
        "seconds": median,
        "prompt": prompt,
        "new_tokens": new_tokens,
        "batch": batch,
        "tokens": tokens,
        "onnxruntime_genai": og.__version__ if hasattr(og, "__version__") else None,
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def serve(folder: str, *, ids_file: str, new_tokens: int) -> None:
    """Inside the genai venv: load ``folder`` once, then for each ``run`` line on stdin,
    generate greedily from the prompt in ``ids_file`` (a ``.npy`` of int64 ``(batch, prompt)``)
    and print one JSON line: its ``seconds`` and ``tokens`` (prompt plus new, per sequence).
    A benchmark drives it (:class:`GenaiServer`) to time genai in rounds beside its other
    contenders."""
    import sys

    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(folder)
    ids = np.load(ids_file).astype(np.int64)
    batch, prompt = ids.shape
    total = prompt + new_tokens
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        params = og.GeneratorParams(model)
        # min_length: exactly ``new_tokens`` per sequence, as the other contenders (no end of sequence)
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=batch)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        seconds = time.perf_counter() - start
        tokens = [list(map(int, generator.get_sequence(b))) for b in range(batch)]
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


class GenaiServer:
    """A genai process serving timed generations (see :func:`serve`), from the Python named by
    ``PLACEMENT_GENAI_PYTHON``."""

    def __init__(self, python: str, folder: str | os.PathLike[str], ids_file: str, new_tokens: int) -> None:
        cmd = [python, str(Path(__file__).resolve()), str(folder), "--serve", "--ids-file", ids_file]
        cmd += ["--new-tokens", str(new_tokens)]
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def run(self) -> dict[str, Any]:
        """One generation: ``{"seconds": ..., "tokens": [[...], ...]}``."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            error = self.process.stderr.read() if self.process.stderr is not None else ""
            last = (error.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"onnxruntime-genai failed: {last}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def build_genai_model(python: str, hf_folder: Path, out: Path, *, timeout: float = 1800.0) -> str | None:
    """Run onnxruntime-genai's model builder (fp32, CPU) in ``python`` on a Hugging Face folder;
    None when it worked, else why not."""
    cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out)]
    cmd += ["-p", "fp32", "-e", "cpu", "-c", str(out / "cache")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"the genai model builder ran past {timeout:.0f} s"
    if done.returncode != 0:
        return "the genai model builder failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a model folder built by onnxruntime-genai's builder")
    parser.add_argument("--run", action="store_true", help="measure here (this Python has onnxruntime-genai)")
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", action="store_true", help="serve timed runs on stdin (see serve())")
    parser.add_argument("--ids-file", help="--serve: the prompt, a .npy of int64 (batch, prompt)")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.folder, ids_file=args.ids_file, new_tokens=args.new_tokens)
        return
    options = {
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "repeats": args.repeats,
    }
    if args.run:
        result = measure(args.folder, **options)
    else:
        result = genai_tokens_per_s(args.folder, **options)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
