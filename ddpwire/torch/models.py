"""The demo models: an MLP for the digits, and a tiny transformer with protocol-shaped blocks.

Both draw their initial weights from their own ``torch.Generator`` seeded by
the ``seed`` argument, never from torch's global generator, so workers built
in different threads or processes start bit-identical.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .buffer import BLOCK_COMPONENTS, Segment, block_segment

__all__ = ["DigitsMLP", "RMSNorm", "Block", "TinyTransformer"]


def _seeded_init(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm scales
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


class DigitsMLP(nn.Module):
    """64 pixel features -> hidden -> 10 digit logits."""

    def __init__(self, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.out = nn.Linear(hidden, 10)
        _seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.hidden(x)))


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (written out: nn.RMSNorm needs torch>=2.4)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """Pre-norm causal attention plus a SwiGLU feed-forward, named as the protocol names them."""

    def __init__(self, dim: int, n_heads: int, ffn: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim {dim} is not a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.input_norm = RMSNorm(dim)
        self.w_q = nn.Linear(dim, dim, bias=False)
        self.w_k = nn.Linear(dim, dim, bias=False)
        self.w_v = nn.Linear(dim, dim, bias=False)
        self.w_o = nn.Linear(dim, dim, bias=False)
        self.post_attn_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_norm(x)

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(heads(self.w_q(h)), heads(self.w_k(h)), heads(self.w_v(h)), is_causal=True)
        x = x + self.w_o(att.transpose(1, 2).reshape(b, t, d))
        h = self.post_attn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyTransformer(nn.Module):
    """A decoder-only language model small enough to train on a CPU in seconds.

    ``embedding`` holds the token table and a learned position table (both go
    into the wire's ``embedding`` component).
    """

    def __init__(
        self,
        vocab: int = 16,
        dim: int = 32,
        n_blocks: int = 2,
        n_heads: int = 2,
        ffn: int = 64,
        max_len: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, ffn) for _ in range(n_blocks))
        self.final_norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        _seeded_init(self, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, t, vocab) for int64 ``tokens`` (batch, t); a ``t``
        over ``max_len`` is a ValueError."""
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_len {self.max_len}")
        x = self.embedding(tokens) + self.position.weight[:t]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))

    def gradient_layout(self) -> Tuple[Segment, ...]:
        """Segments for per-block sending: embedding, each block, final_norm, lm_head."""
        blocks = tuple(
            Segment.of(block_segment(i), [(c, getattr(block, c)) for c in BLOCK_COMPONENTS])
            for i, block in enumerate(self.blocks)
        )
        return (
            Segment.of("embedding", [("embedding", [self.embedding.weight, self.position.weight])]),
            *blocks,
            Segment.of("final_norm", [("final_norm", self.final_norm)]),
            Segment.of("lm_head", [("lm_head", self.lm_head)]),
        )
