"""The reference models' networks, built by the configs of experiments/workloads/models.py
(each function and class takes its config: `cfg` is an MLPConfig, CNNConfig, GPTConfig or
DLRMConfig there)."""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn


def mlp(cfg) -> nn.Module:
    """Flatten, then Linear/ReLU layers, then a Linear to the classes."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = cfg.inputs
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, cfg.classes))
    return nn.Sequential(*layers)


def cnn(cfg) -> nn.Module:
    """Two conv/batch-norm/ReLU/max-pool stages and a Linear, on (B, 1, 28, 28) images."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=5, padding=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=5, padding=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(7 * 7 * 32, cfg.classes),
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) int64 -> next-token logits (B, T, vocab_size)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # Untied from wte so that every parameter is a distinct tensor for the engines' buckets and keys.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init: keeps the residual stream's variance flat as depth grows.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class SparseLogReg(nn.Module):
    """(indices (B, k) int64, values (B, k) float) -> logits (B,)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        # sparse=False: the engines reduce and push dense tensors, and optimizers like Adam reject sparse grads.
        self.weight = nn.EmbeddingBag(features, 1, mode="sum", sparse=False)
        self.bias = nn.Parameter(torch.zeros(()))
        # The problem is convex, so the conventional zero start loses nothing and is easy to reason about.
        nn.init.zeros_(self.weight.weight)

    def forward(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.weight(indices, per_sample_weights=values).squeeze(-1) + self.bias

    def row_ids(self, indices: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """{table parameter: the row ids forward(indices, values) will look up}: lets an
        engine fetch those rows before the forward."""
        return {"weight.weight": indices}


def _mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """(dense (B, D) float, ids (B, T) int64) -> logits (B,)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.bottom = _mlp([cfg.dense, *cfg.bottom, cfg.dim], last_relu=True)
        # sparse=False: every engine moves dense gradients today; rows an example did not touch
        # get zeros, which SGD and Adagrad leave unchanged.
        self.tables = nn.ModuleList(nn.Embedding(rows, cfg.dim) for rows in cfg.tables)
        for table, rows in zip(self.tables, cfg.tables):
            bound = 1.0 / math.sqrt(rows)  # DLRM's uniform(-1/sqrt(n), 1/sqrt(n))
            nn.init.uniform_(table.weight, -bound, bound)
        features = len(cfg.tables) + 1
        self._pairs = torch.triu_indices(features, features, offset=1)
        self.top = _mlp([cfg.dim + features * (features - 1) // 2, *cfg.top, 1], last_relu=False)

    def row_ids(self, dense: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """{table parameter: the row ids forward(dense, ids) will look up}: lets an engine
        fetch those rows before the forward."""
        return {f"tables.{i}.weight": ids[:, i] for i in range(len(self.tables))}

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] != len(self.tables):
            raise ValueError(f"DLRM has {len(self.tables)} tables but the batch has {ids.shape[1]} ids per example")
        x = self.bottom(dense)
        feats = torch.stack([x, *(t(ids[:, i]) for i, t in enumerate(self.tables))], dim=1)
        dots = torch.bmm(feats, feats.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(-1)
