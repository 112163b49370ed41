"""``placement generate MODEL``: generate tokens with a causal LM split across devices.

MODEL is an ONNX file with a KV cache (``past_key_values.{i}.key/value`` in,
``present.{i}.key/value`` out: saved from :func:`placement.from_causal_lm`, placed or not)
or a local Hugging Face model folder (``config.json`` and weights; exported with its
cache). Without a placement, ``--devices N`` places it on N devices with the planner.
Prints the prompt plus new ids, or the text with ``--tokenizer DIR``.

Example:
    $ placement generate llama.onnx --input-ids 5,17,33 --max-new-tokens 32 --devices 2
    $ placement generate ./tiny-llama --prompt "Hello" --tokenizer ./tiny-llama --runtime torch
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import placement as pl
from placement.cli.common import step


def add_parser(sub: Any) -> None:
    """Add ``placement generate`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "generate",
        help="generate tokens with a causal LM (KV cache) split across devices",
        description=(
            "Generate with MODEL: an .onnx file with a KV cache (past_key_values.{i}.key/value inputs, "
            "present.{i}.key/value outputs) or a local Hugging Face model folder. Prints the prompt "
            "plus the new token ids (or the text, with --tokenizer) and the tokens per second."
        ),
        epilog="Example: placement generate llama.onnx --input-ids 5,17,33 --max-new-tokens 32 --devices 2",
    )
    p.add_argument("model", metavar="MODEL", help="an .onnx file with a KV cache, or a Hugging Face folder")
    p.add_argument("--input-ids", metavar="IDS", help="prompt token ids, comma separated (5,17,33)")
    p.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    p.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer folder: decode the output to text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens at most (default 32)")
    p.add_argument("--devices", type=int, help="place an unplaced model on N devices (the planner)")
    p.add_argument("--runtime", default="ort", choices=["ort", "torch"], help="runtime (default ort)")
    p.add_argument("--device-map", default="auto", help="auto (default), cpu, or cuda:0")
    p.add_argument("--chunks", type=int, default=1, help="groups of sequences in flight (default 1)")
    p.add_argument("--eos-token-id", type=int, help="stop a sequence after this token")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement generate`` with the parsed ``args``, printing to ``console``; the exit status."""
    tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
    ids = _prompt_ids(args, tokenizer)
    with step(console, f"loading {args.model}"):
        model = _load(Path(args.model))
    if args.devices is not None:
        if args.devices < 1:
            raise pl.InputError(f"--devices must be at least 1, got {args.devices}")
        if len(model.devices) > 1:
            raise pl.InputError(
                f"{args.model} is already placed on {len(model.devices)} devices; drop --devices"
            )
        with step(console, f"placing on {args.devices} devices"):
            pl.auto_place(model, devices=args.devices, cost="flops")
    with step(console, f"building the {args.runtime} runtime"):
        generator = pl.Generator(model, runtime=args.runtime, device_map=args.device_map, chunks=args.chunks)
    start = time.perf_counter()
    out = generator.generate(
        [ids],
        max_new_tokens=args.max_new_tokens,
        eos_token_id=args.eos_token_id,
        do_sample=args.sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    seconds = time.perf_counter() - start
    tokens = [int(t) for t in out[0]]
    if tokenizer is not None:
        console.print(tokenizer.decode(tokens), highlight=False, markup=False)
    else:
        console.print(",".join(str(t) for t in tokens), highlight=False)
    new = len(tokens) - len(ids)
    devices = ", ".join(str(d) for d in model.devices)
    console.print(
        f"{new} new tokens in {seconds:.3f} s ({new / seconds:.1f} tokens/s; {args.runtime} on {devices})",
        highlight=False,
    )
    return 0


def _prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    if args.input_ids and args.prompt:
        raise pl.InputError("give --input-ids or --prompt, not both")
    if args.prompt is not None:
        if tokenizer is None:
            raise pl.InputError("--prompt needs --tokenizer DIR")
        return [int(t) for t in tokenizer(args.prompt)["input_ids"]]
    if not args.input_ids:
        raise pl.InputError("give the prompt: --input-ids 5,17,33 (or --prompt with --tokenizer)")
    try:
        ids = [int(t) for t in args.input_ids.split(",") if t.strip()]
    except ValueError as err:
        raise pl.InputError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from err
    if not ids or min(ids) < 0:
        raise pl.InputError(f"--input-ids must be non-negative token ids, got {args.input_ids!r}")
    return ids


def _tokenizer(folder: str) -> Any:
    path = Path(folder)
    if not path.is_dir():
        raise pl.InputError(f"--tokenizer {folder}: not a folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _load(path: Path) -> pl.Model:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise pl.InputError(f"{path} is a folder without config.json (not a Hugging Face model)")
        import torch
        from transformers import AutoModelForCausalLM

        net = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
        return pl.from_causal_lm(net, torch.tensor([[1, 2, 3]]))
    if not path.is_file():
        raise pl.InputError(f"{path}: no such file or folder")
    return pl.load(path)
