"""``pl.generate`` and ``pl.Generator``: the decode loop over a placed causal LM, on either runtime.

A :class:`Generator` prepares the model once (:func:`~placement.generation.prepare.decoder_model`:
last-position logits, copies, each layer's cache on its layer's device), builds the
runtime once (:class:`~placement.generation.ort_decoder.OrtDecoder`: one ONNX Runtime
session per stage, caches in device buffers bound through ``IOBinding``;
:class:`~placement.generation.torch_decoder.TorchDecoder`: the lowered module with a
static cache updated in place) and keeps the cache buffers between calls (they grow,
in steps of 256 tokens, only when a call needs more). Each :meth:`Generator.generate`
call runs the prompt as one step (prefill), then one step per new token, feeding each
step only the new token, the attention mask and the position.

Pipelined generation (``chunks=k``, ONNX Runtime): the batch is split into ``k`` groups,
each with its own cache, and one worker thread per stage runs whichever group reaches
it: while the last stage computes group 0's step, the first computes group 1's, so
every stage is busy (a stage that only reads shapes runs on the next stage's worker; the
workers hand groups over through ``queue.SimpleQueue`` s; the last worker picks the
group's tokens and feeds its next step to the first). Each group's tokens are the ones it
would get alone (greedy decoding gives the same tokens for every ``chunks``). On the torch
runtime, ``chunks=k`` lowers the model as a pipelined module (``pl.to_torch(chunks=k)``): each step's batch
runs through the stages as ``k`` micro-batches (fill-drain within the step), with the same
tokens.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import placement as pl
    >>> net = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
    >>> model = pl.from_causal_lm(net, torch.tensor([[1, 2, 3]]))
    >>> out = pl.generate(model, np.array([[5, 17, 33]]), max_new_tokens=4, device_map="cpu")
    >>> out.shape
    (1, 7)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any, TypedDict, Unpack

import numpy as np

from placement.errors import InputError, PlacementError
from placement.generation.prepare import CacheDims, decoder_model
from placement.generation.sampling import Sampler
from placement.generation.sequences import Sequences
from placement.graph.model import Model
from placement.runtime.device_map import DeviceMapLike

__all__ = ["RUNTIMES", "GenerateOptions", "Generator", "generate"]

log = logging.getLogger(__name__)

#: The runtimes a decode loop runs on.
RUNTIMES = ("ort", "torch")
_GROW = 256  # cache buffers grow in steps of this many tokens


class Generator:
    """A placed causal LM ready to generate: sessions (or the lowered module) and caches built once.

    Args:
        model: a placed model with a KV cache (:func:`placement.from_causal_lm`, or a file in
            the same convention loaded by :func:`placement.load`); it is not modified.
        runtime: ``"ort"`` (one ONNX Runtime session per stage) or ``"torch"``.
        device_map: logical -> physical devices (``"auto"``: GPUs, else each logical device
            emulated on the CPU; ``"cpu"``: everything folded into the CPU).
        chunks: groups of sequences in flight (pipelined generation; on torch, micro-batches
            of each step), see the module docstring.
        cuda_graphs: torch runtime on GPUs: replay decode steps as CUDA graphs.
        cache_dims: sizes of cache dimensions the file leaves symbolic (``{"kv_cache_dim":
            64}``), or a ``genai_config.json`` to read them from; :func:`placement.load` reads
            the ``genai_config.json`` beside a file by itself.
        threads_per_stage: ONNX Runtime: intra-op threads of each stage session (None:
            ONNX Runtime's choice for ``chunks=1``, the CPU's cores divided among the
            logical devices for ``chunks > 1``). Give emulated devices the same budget in
            both to compare ``chunks`` at equal cores per device.

    Raises:
        InputError: the model is not a causal LM with a cache, or an option is invalid.

    Example:
        >>> import numpy as np
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> import placement as pl
        >>> net = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=40))
        >>> generator = pl.Generator(pl.from_causal_lm(net, torch.tensor([[4, 5]])), device_map="cpu")
        >>> generator.generate(np.array([[4, 5, 6]]), max_new_tokens=3).shape
        (1, 6)
    """

    def __init__(
        self,
        model: Model,
        *,
        runtime: str = "ort",
        device_map: DeviceMapLike = "auto",
        chunks: int = 1,
        cuda_graphs: bool = False,
        cache_dims: CacheDims = None,
        threads_per_stage: int | None = None,
    ) -> None:
        if runtime not in RUNTIMES:
            raise InputError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        if not isinstance(chunks, int) or chunks < 1:
            raise InputError(f"chunks must be a positive integer, got {chunks!r}")
        self.runtime = runtime
        self.chunks = chunks
        self.spec = decoder_model(model, cache_dims=cache_dims)
        self.decoder: Any
        if runtime == "ort":
            from placement.generation.ort_decoder import OrtDecoder

            if cuda_graphs:
                raise InputError("cuda_graphs=True is a torch runtime option (runtime='torch')")
            self.decoder = OrtDecoder(
                self.spec, device_map=device_map, chunks=chunks, threads_per_stage=threads_per_stage
            )
        else:
            from placement.generation.torch_decoder import TorchDecoder

            if threads_per_stage is not None:
                raise InputError("threads_per_stage is an ONNX Runtime option (runtime='ort')")

            self.decoder = TorchDecoder(
                self.spec, device_map=device_map, chunks=chunks, cuda_graphs=cuda_graphs
            )
        self._slots: list[Any] = []
        self._lock = threading.Lock()

    @property
    def copy_stats(self) -> Any:
        """ORT runtime: bytes the stage-to-stage transfers moved since the last reset
        (:class:`~placement.generation.ort_decoder.CopyStats`); None on torch."""
        return getattr(self.decoder, "stats", None)

    def generate(
        self,
        input_ids: Any,
        *,
        max_new_tokens: int,
        attention_mask: Any = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        streamer: Any = None,
    ) -> Any:
        """Prompt plus up to ``max_new_tokens`` new tokens per sequence (the options: see
        :func:`generate`)."""
        ids, mask, as_torch = _prompt(input_ids, attention_mask)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        eos = (
            ()
            if eos_token_id is None
            else ((eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id))
        )
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        groups = self._groups(ids.shape[0])
        if streamer is not None and len(groups) > 1:
            raise InputError("a streamer needs chunks=1 (pipelined groups finish steps out of order)")
        if streamer is not None:
            streamer.put(ids)
        sequences = [
            Sequences(
                ids[lo:hi],
                mask[lo:hi],
                max_new_tokens=max_new_tokens,
                eos=eos,
                pad=pad,
                sampler=Sampler(do_sample, temperature, top_k, top_p, None if seed is None else seed + g),
                on_tokens=None if streamer is None else (lambda tokens: streamer.put(tokens)),
            )
            for g, (lo, hi) in enumerate(groups)
        ]
        length = ids.shape[1] + max_new_tokens
        with self._lock:
            slots = self._take_slots([hi - lo for lo, hi in groups], length)
            if len(sequences) == 1:
                self._run_one(slots[0], sequences[0])
            else:
                self._run_pipelined(slots, sequences)
        if streamer is not None:
            streamer.end()
        width = max(seq.count for seq in sequences)
        rows = [np.pad(s.result(), ((0, 0), (0, width - s.count)), constant_values=pad) for s in sequences]
        out = np.concatenate(rows, axis=0)
        if as_torch:
            import torch

            return torch.from_numpy(out)
        return out

    # -- internals ------------------------------------------------------------------------------

    def _groups(self, batch: int) -> list[tuple[int, int]]:
        groups = 1 if self.runtime == "torch" else min(self.chunks, batch)
        bounds = np.linspace(0, batch, groups + 1).round().astype(int)
        return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def _take_slots(self, sizes: list[int], length: int) -> list[Any]:
        """Cache slots for groups of ``sizes`` sequences up to ``length`` tokens (reused when big enough)."""
        for index, size in enumerate(sizes):
            slot = self._slots[index] if index < len(self._slots) else None
            if slot is None or slot.batch < size or slot.max_length < length:
                capacity = (max(size, getattr(slot, "batch", 0)), -(-length // _GROW) * _GROW)
                slot = self.decoder.new_slot(*capacity)
                if index < len(self._slots):
                    self._slots[index] = slot
                else:
                    self._slots.append(slot)
                log.debug("cache slot %d: %d sequences x %d tokens", index, *capacity)
            self.decoder.start(slot, size)
        return self._slots[: len(sizes)]

    def _run_one(self, slot: Any, seqs: Sequences) -> None:
        seqs.advance(self.decoder.step(slot, seqs.prefill()))
        while not seqs.done:
            seqs.advance(self.decoder.step(slot, seqs.decode()))

    def _run_pipelined(self, slots: list[Any], groups: list[Sequences]) -> None:
        """Groups in flight through one worker per stage part (ORT): see the module docstring."""
        decoder = self.decoder
        workers = decoder.workers
        last = len(workers) - 1
        inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in workers]
        finished: queue.SimpleQueue = queue.SimpleQueue()

        def work(index: int) -> None:
            parts, inbox = workers[index], inboxes[index]
            run_part = decoder.run_part
            while True:
                item = inbox.get()
                if item is None:
                    return
                g, values, new_tokens = item
                try:
                    for part in parts:
                        run_part(part, slots[g], values, new_tokens)
                    if index < last:
                        inboxes[index + 1].put(item)
                        continue
                    seqs = groups[g]
                    seqs.advance(decoder.finish(slots[g], values, new_tokens))
                    if seqs.done:
                        finished.put((g, None))
                    else:
                        inboxes[0].put((g, decoder.feed(seqs.decode()), 1))
                except BaseException as err:  # handed to the caller's thread
                    finished.put((g, err))

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(workers))]
        for thread in threads:
            thread.start()
        try:
            for g, seqs in enumerate(groups):
                prompt = seqs.prefill()
                inboxes[0].put((g, decoder.feed(prompt), prompt["input_ids"].shape[1]))
            errors = [finished.get()[1] for _ in groups]
        finally:
            for inbox in inboxes:
                inbox.put(None)
            for thread in threads:
                thread.join()
        failure = next((err for err in errors if err is not None), None)
        if failure is not None:
            if isinstance(failure, PlacementError):
                raise failure
            raise PlacementError(f"pipelined generation failed: {failure}") from failure


def _prompt(input_ids: Any, attention_mask: Any) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, mask) as int64 numpy ``(batch, length)``, and whether the ids came as a torch tensor."""
    as_torch = type(input_ids).__module__.startswith("torch")
    ids = np.asarray(input_ids.cpu() if as_torch else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"input_ids must be integer token ids (batch, length), got shape {ids.shape}")
    ids = ids.astype(np.int64)
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask_in = attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask
        mask = np.asarray(mask_in).astype(np.int64).reshape(ids.shape[0], -1)
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}")
        if (mask.sum(-1) == 0).any():
            raise InputError("attention_mask: every sequence needs at least one token")
    return ids, mask, as_torch


class GenerateOptions(TypedDict, total=False):
    """The options of :meth:`Generator.generate` that :func:`generate` passes on (see there)."""

    attention_mask: Any
    eos_token_id: int | Sequence[int] | None
    pad_token_id: int | None
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    streamer: Any


def generate(
    model: Model,
    input_ids: Any,
    *,
    max_new_tokens: int,
    runtime: str = "ort",
    device_map: DeviceMapLike = "auto",
    chunks: int = 1,
    cuda_graphs: bool = False,
    cache_dims: CacheDims = None,
    **options: Unpack[GenerateOptions],
) -> Any:
    """Generate with a placed causal LM: prompt plus new tokens (numpy, or torch for torch ids).

    Builds a :class:`Generator` and calls it once; keep a :class:`Generator` to serve several
    calls without rebuilding sessions and caches.

    Args:
        model: a placed model with a KV cache (:func:`placement.from_causal_lm`, or a file in
            the same convention, such as one built by onnxruntime-genai, loaded by
            :func:`placement.load`).
        input_ids: prompt token ids ``(batch, length)``, left padded for batches of mixed length.
        max_new_tokens: new tokens per sequence at most.
        runtime: ``"ort"`` or ``"torch"``.
        device_map: logical -> physical devices (``"auto"``, ``"cpu"``, a dict).
        chunks: groups of sequences in flight through the stages (pipelined generation).
        cuda_graphs: torch runtime on GPUs: decode steps as CUDA graphs.
        cache_dims: sizes of cache dimensions the file leaves symbolic (see :class:`Generator`).
        **options: as :meth:`Generator.generate`:

            * ``attention_mask``: ``(batch, length)``, 0 on left padding (default: all ones);
            * ``eos_token_id``: end-of-sequence id(s): a sequence ends after one; ``None``
              generates exactly ``max_new_tokens``. Ended sequences are padded with
              ``pad_token_id`` (default: the first end-of-sequence id);
            * ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``: sampling (default
              greedy); see :class:`~placement.generation.sampling.Sampler`;
            * ``streamer``: an object with ``put(tokens)`` and ``end()`` (``transformers``'
              streamers): given the prompt, then each step's new tokens.

    Raises:
        InputError: bad ids, mask or options, or a model without a KV cache.

    Example:
        >>> import numpy as np
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> import placement as pl
        >>> net = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=40))
        >>> model = pl.from_causal_lm(net, torch.tensor([[4, 5]]))
        >>> pl.generate(model, np.array([[4, 5, 6]]), max_new_tokens=2, runtime="torch").shape
        (1, 5)
    """
    generator = Generator(
        model,
        runtime=runtime,
        device_map=device_map,
        chunks=chunks,
        cuda_graphs=cuda_graphs,
        cache_dims=cache_dims,
    )
    return generator.generate(input_ids, max_new_tokens=max_new_tokens, **options)
