"""Rebuild the onnxruntime-genai model files under ``tests/genai_files/``.

Run it with the Python of a virtual environment of its own that holds
``onnxruntime-genai``, ``transformers`` and ``torch`` (never the project's
``.venv``: onnxruntime-genai brings plain ``onnxruntime``, which must not share
an environment with ``onnxruntime-gpu``)::

    python3 -m venv /tmp/genai-venv
    /tmp/genai-venv/bin/pip install onnxruntime-genai transformers torch
    /tmp/genai-venv/bin/python scripts/build_genai_files.py

It saves a tiny Llama with random weights (2 layers, hidden size 64, grouped-query
attention with 4 query and 2 key/value heads, vocabulary 128) with
``save_pretrained``, runs onnxruntime-genai's model builder on it in fp32 and int4
(``MatMulNBits``), and writes beside each built model ``expected.json``: the
tokens genai's own ``og.Generator`` picks greedily for a fixed prompt, and the
versions that built them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: The prompt and length every check of these files uses.
PROMPT = [5, 17, 33, 2, 90, 41, 7, 64]
NEW_TOKENS = 16
#: Builder precisions: folder name -> ``-p`` value.
PRECISIONS = {"llama_fp32": "fp32", "llama_int4": "int4"}
#: Files the builder writes that the tests do not need (tokenizer files; there is no tokenizer).
_KEEP = {"model.onnx", "model.onnx.data", "genai_config.json"}


def save_tiny_llama(folder: Path) -> None:
    """Save a tiny random Llama (seeded) as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder, config.vocab_size)


def save_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` made-up words (the builder reads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(folder)


def build(hf_folder: Path, out: Path, precision: str) -> None:
    """Run genai's model builder on ``hf_folder`` into ``out``."""
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out)]
        cmd += ["-p", precision, "-e", "cpu", "-c", cache]
        subprocess.run(cmd, check=True)
    for path in out.iterdir():
        if path.name not in _KEEP:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def greedy_tokens(folder: Path) -> list[int]:
    """The tokens ``og.Generator`` picks greedily after :data:`PROMPT`."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + NEW_TOKENS)
    generator = og.Generator(model, params)
    generator.append_tokens(PROMPT)
    tokens: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "genai_files"
    )
    args = parser.parse_args()
    import onnxruntime
    import onnxruntime_genai
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        hf_folder = Path(tmp) / "hf"
        save_tiny_llama(hf_folder)
        for name, precision in PRECISIONS.items():
            target = args.out / name
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            build(hf_folder, target, precision)
            expected = {
                "prompt": PROMPT,
                "new_tokens": greedy_tokens(target),
                "built_with": {
                    "onnxruntime-genai": onnxruntime_genai.__version__,
                    "onnxruntime": onnxruntime.__version__,
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                },
            }
            (target / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
            print(name, expected["new_tokens"])


if __name__ == "__main__":
    main()
