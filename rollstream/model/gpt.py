"""A small decoder-only transformer (pre-LN, learned and/or rotary positions, SDPA attention), KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollstream.config import Position, gpt_shape_error


@dataclass
class GPTConfig:
    """Size of the tiny GPT policy; the defaults give ~100k parameters with the char vocabulary."""

    vocab_size: int  # token ids (embedding rows); CharTokenizer().vocab_size for the built-in tasks
    d_model: int = 64  # residual width
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads (d_model must divide evenly)
    max_seq_len: int = 64  # largest position id + 1 (prompt + response, padding excluded)
    dropout: float = 0.0  # dropout on attention output, MLP output and embeddings
    position: Position = "learned"  # see Position
    rope_theta: float = 10000.0  # rotary base (position "rope" or "learned+rope")

    def __post_init__(self) -> None:
        """Refuse shapes the blocks cannot build, naming the field and value."""
        problem = gpt_shape_error(self.d_model, self.n_head, self.position)
        if problem:
            raise ValueError(problem)


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids [B,T] of a left-padded mask [B,T]: 0 at the first real token, 0 on leading pads."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def rope_angles(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B,1,T,head_dim/2] of the rotary angles position * theta^(-2i/head_dim)."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    angles = position_ids.float()[:, None, :, None] * inv_freq  # [B,1,T,hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) of x [B,H,T,hd] by the angles (the Llama/NeoX layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class KVCache:
    """Preallocated keys/values per layer, [B, H, capacity, head_dim]; `length` positions are filled."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        capacity: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch, n_head, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.capacity = capacity
        self.length = 0

    def update(self, layer: int, k: Tensor, v: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        """Write k, v [B,H,T,hd] at `start_pos`; return all keys/values up to start_pos + T."""
        end = start_pos + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KVCache overflow: {end} > capacity {self.capacity}")
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def select(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (drop finished sequences)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via F.scaled_dot_product_attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        layer: int,
        start_pos: int,
        cache: KVCache | None,
        mask: Tensor | None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x [B,T,C] -> [B,T,C]; `mask` [B,1,T,Tk] bool (True = attend) or None for plain causal; `rope`
        (cos, sin) rotates queries and keys (keys are cached rotated)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B,H,T,hd]
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)  # [B,H,Tk,hd]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(
        self,
        x: Tensor,
        layer: int,
        start_pos: int,
        cache: KVCache | None,
        mask: Tensor | None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x [B,T,C] -> [B,T,C]."""
        x = x + self.attn(self.ln1(x), layer, start_pos, cache, mask, rope)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; the output head is tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position != "rope" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style init (normal 0.02, residual projections scaled by 1/sqrt(2*n_layer))."""
        proj_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                std = proj_std if name.endswith("attn.proj") or name.endswith("mlp.2") else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std, generator=generator)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02, generator=generator)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for `batch` rows and `capacity` positions, on this model's device/dtype."""
        w = self.tok_emb.weight
        return KVCache(
            self.cfg.n_layer,
            batch,
            self.cfg.n_head,
            capacity,
            self.cfg.d_model // self.cfg.n_head,
            w.device,
            w.dtype,
        )

    def forward(
        self,
        idx: Tensor,
        start_pos: int = 0,
        cache: KVCache | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> Tensor:
        """idx [B,T] long -> logits [B,T,V] (or [B,logits_to_keep,V] for the last positions when > 0).

        `start_pos`: cache positions already filled (tokens of idx go at start_pos..start_pos+T-1).
        `position_ids` [B,T]: position of each token (default start_pos + arange(T)); indexes the learned
        embeddings, or sets the rotary angles.
        `attention_mask` [B, start_pos+T]: 1 for real tokens, 0 for padding (keys masked out); every
        query also sees itself, so pad rows stay finite. With a cache, `cache.length` is advanced.
        """
        B, T = idx.shape
        device = idx.device
        if position_ids is None:
            position_ids = torch.arange(start_pos, start_pos + T, device=device).expand(B, T)
        if int(position_ids.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(position_ids.max())} >= max_seq_len={self.cfg.max_seq_len}")
        mask: Tensor | None = None
        if attention_mask is not None or start_pos > 0:
            Tk = start_pos + T
            q_pos = torch.arange(start_pos, Tk, device=device)[:, None]  # [T,1]
            k_pos = torch.arange(Tk, device=device)[None, :]  # [1,Tk]
            allowed = (k_pos <= q_pos)[None, None]  # [1,1,T,Tk]
            if attention_mask is not None:
                if attention_mask.shape != (B, Tk):
                    raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != {(B, Tk)}")
                allowed = allowed & attention_mask.bool()[:, None, None, :]
                allowed = allowed | (k_pos == q_pos)[None, None]
            mask = allowed
        x = self.tok_emb(idx)  # [B,T,C]
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(position_ids)
        if self.cfg.position != "learned":
            rope = rope_angles(position_ids, self.cfg.d_model // self.cfg.n_head, self.cfg.rope_theta)
        x = self.drop(x)
        for layer, block in enumerate(self.blocks):
            x = block(x, layer, start_pos, cache, mask, rope)
        if cache is not None:
            cache.length = start_pos + T
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # [B,T,V]
