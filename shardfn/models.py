"""Small reference models for the demo, the benchmarks and the tests: a GPT and an MLP.

Both are plain `nn.Module`s; nothing in them knows about shardfn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "MLP"]


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2-style decoder.

    Attributes:
        vocab: vocabulary size.
        block_size: the longest sequence.
        n_layer: transformer blocks.
        n_head: attention heads (must divide `d`).
        d: model width.
        tie: tie the output head to the token embedding.
    """

    vocab: int = 8192
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d: int = 256
    tie: bool = True

    def __post_init__(self) -> None:
        if self.d % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d={self.d}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` blocks (`blocks.0` ...), final norm, (tied) head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.tie:
            self.head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(cfg.block_size), persistent=True)
        self.register_buffer("emb_scale", torch.ones(()), persistent=False)  # a float buffer, for buffer_dtype
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `idx` (batch, T); `pos`: the tokens' positions (default `0..T-1`), for a
        sequence split over ranks (context parallelism) where each rank holds part of it."""
        T = idx.shape[1]
        x = self.wte(idx) * self.emb_scale + self.wpe(self.pos[:T] if pos is None else pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding of `new_tokens` tokens."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


class MLP(nn.Module):
    """`n_layer` blocks (`blocks.0` ...) of Linear(d, d) + ReLU."""

    def __init__(self, d: int = 2048, n_layer: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
