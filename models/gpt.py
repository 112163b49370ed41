"""A GPT-style decoder-only transformer language model (nanoGPT layout).

Architecture (pre-norm)::

    idx (batch, seq) int64 token ids
      -> wte(idx) + wpe(0..seq-1)                     token + learned position embeddings
      -> blocks.0 .. blocks.<n_layer-1>, each:
             x = x + attn(ln_1(x))                    causal multi-head self-attention
             x = x + mlp(ln_2(x))                     c_fc -> GELU -> c_proj (4x width)
      -> ln_f -> lm_head                              logits (batch, seq, vocab_size)

Attention is written out by hand: one ``c_attn`` projection to q, k, v, ``q @ k^T / sqrt(d_head)``,
the boolean ``mask`` buffer (True above the diagonal) applied with ``masked_fill(-inf)``, ``softmax``,
``@ v``, heads merged, ``c_proj``. ``F.scaled_dot_product_attention`` is deliberately not used, so the
exported graph uses only common ONNX ops (``MatMul``, ``Softmax``, ``Where``, ``LayerNormalization``,
``Gelu``, ``Gather``, ``Reshape``, ``Transpose``, ...). The LM head has no bias and its weight is
*tied* to the token embedding (``lm_head.weight is wte.weight``). No dropout (inference only).

Example:
    >>> from placement.models import gpt
    >>> module, (idx,) = gpt.build("tiny")
    >>> module(idx).shape
    torch.Size([2, 8, 64])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from placement.models._sizes import lookup_size

__all__ = ["GPT", "SIZES", "Block", "CausalSelfAttention", "GPTConfig", "Size", "build"]


@dataclass(frozen=True)
class GPTConfig:
    """Model hyperparameters."""

    vocab_size: int = 64
    block_size: int = 16  # longest sequence (size of the causal mask and of ``wpe``)
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")


@dataclass(frozen=True)
class Size:
    """A named size: the model config and the example batch and sequence length."""

    config: GPTConfig
    batch: int
    seq: int


SIZES: dict[str, Size] = {
    "tiny": Size(GPTConfig(), batch=2, seq=8),
    "bench": Size(
        GPTConfig(vocab_size=2048, block_size=128, n_layer=6, n_head=4, d_model=256),
        batch=2,
        seq=128,
    ),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` attends to positions ``<= t`` only.

    Example:
        >>> import torch
        >>> CausalSelfAttention(GPTConfig())(torch.zeros(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)
        self.c_proj = nn.Linear(config.d_model, config.d_model)
        n = config.block_size
        # True above the diagonal: the (query, key) pairs where the key lies in the future.
        self.register_buffer("mask", torch.ones(n, n, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, d_head)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network: ``c_fc`` (4x wider) -> GELU -> ``c_proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx)`` maps token ids to next-token logits.

    Example:
        >>> import torch
        >>> net = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, d_model=8))
        >>> net(torch.zeros(3, 4, dtype=torch.int64)).shape
        torch.Size([3, 4, 10])
        >>> net.lm_head.weight is net.wte.weight
        True
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.int64, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-initialize all parameters from ``generator`` (GPT-2 scheme).

        Linear and embedding weights: N(0, 0.02), residual output projections scaled by
        ``1/sqrt(2 * n_layer)``; biases N(0, 0.02); LayerNorm weight N(1, 0.1), bias N(0, 0.1)
        (not the identity, so every parameter affects the output).
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if m is self.lm_head:
                    continue  # tied to wte
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(m.weight, 0.0, std, generator=generator)
                nn.init.normal_(m.bias, 0.0, 0.02, generator=generator)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 0.02, generator=generator)
            elif isinstance(m, nn.LayerNorm):
                nn.init.normal_(m.weight, 1.0, 0.1, generator=generator)
                nn.init.normal_(m.bias, 0.0, 0.1, generator=generator)


def build(size: str = "tiny", *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a :class:`GPT` in eval mode and an example batch of token ids, deterministically.

    Args:
        size: ``"tiny"`` (tests) or ``"bench"`` (benchmarks), see :data:`SIZES`.
        seed: seeds a local ``torch.Generator``; the global RNG state is left untouched.

    Returns:
        ``(module, (idx,))`` with ``idx`` int64 of shape ``(batch, seq)`` in ``[0, vocab_size)``.

    Example:
        >>> module, (idx,) = build("tiny", seed=1)
        >>> tuple(idx.shape), idx.dtype
        ((2, 8), torch.int64)
    """
    cfg = _size(size)
    generator = torch.Generator().manual_seed(seed)
    # The constructor's default init must not disturb the global RNG.
    with torch.random.fork_rng(devices=[]):
        module = GPT(cfg.config)
    module.reset_parameters(generator)
    idx = torch.randint(cfg.config.vocab_size, (cfg.batch, cfg.seq), generator=generator)
    return module.eval(), (idx,)


def _size(size: str) -> Size:
    return lookup_size(SIZES, size, "GPT")
