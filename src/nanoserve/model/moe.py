"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral, Qwen2-MoE): a router, every expert's SwiGLU weights
stacked into one tensor per projection, and Qwen2-MoE's gated shared expert.

Routing (softmax, top-k, renormalize) and the experts run as kernels/moe.py's device kernels, with no host sync and
fixed shapes for a given token count, so MoE layers replay from the same decode and token-count graphs as dense ones.

Tensor parallelism splits each expert's intermediate dimension over the ranks, as a dense MLP's is: every rank
holds a slice of every expert, so every rank reads the same bytes at any batch (whole experts per rank would leave
the rank that holds the most selected experts as the step's slowest at small batch), and one all-reduce per layer
sums the experts' and the shared expert's partial products.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels import moe
from nanoserve.model.communicator import Split, TensorParallel
from nanoserve.model.layers import MLP, ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear, WeightShard

# A checkpoint's per-expert projection names → (our stacked parameter, the part of it: gate 0, up 1, down None).
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
                      "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}  # Mixtral's
_CANONICAL = {("gate_up_proj", 0): "gate_proj", ("gate_up_proj", 1): "up_proj", ("down_proj", None): "down_proj"}


class Experts(nn.Module):
    """num_experts SwiGLU experts: gate_up_proj [E, 2 × I, H] (gate rows, then up rows, of this rank's slice I of the
    intermediate dimension) and down_proj [E, H, I].

    A checkpoint stores them per expert (`experts.N.gate_proj.weight`, or Mixtral's w1/w3/w2), stacked per
    projection (`experts.gate_proj.weight` [E, I, H], GGUF's layout) or stacked as here (transformers 5); the loader
    places each form through weight_shard, whose index is (expert or None for all, part or None for both)."""

    def __init__(self, num_experts: int, hidden_size: int, inter: Split, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter.size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter.size, dtype=dtype),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        """x [T, H] and router logits [T, E] → Σ over each row's top_k experts of weight · expert(x)."""
        return moe.routed_experts(x, logits, self.gate_up_proj, self.down_proj, top_k, renormalize)

    def weight_shard(self, leaf: str, index: tuple[int | None, int | None]) -> WeightShard:
        expert, part = index
        i, num, hidden = self.inter, self.num_experts, self.down_proj.shape[1]
        cols = slice(i.start, i.stop)
        if leaf == "down_proj":
            if expert is None:
                return WeightShard((num, hidden, i.full), (slice(None), slice(None), cols))
            return WeightShard((hidden, i.full), (slice(None), cols), dst_index=(expert,))
        if part is None:  # [E, 2I, H] stacked gate then up: this rank's rows of each
            pieces = None if i.size == i.full else (cols, slice(i.full + i.start, i.full + i.stop))
            return WeightShard((num, 2 * i.full, hidden), None, pieces=pieces)
        rows = slice(part * i.size, (part + 1) * i.size)
        if expert is None:
            return WeightShard((num, i.full, hidden), (slice(None), cols), dst_index=(slice(None), rows))
        return WeightShard((i.full, hidden), (cols,), dst_index=(expert, rows))

    def hf_names(self, prefix: str, leaf: str) -> list[str]:
        """The per-expert names (`prefix.N.gate_proj.weight`...) that a complete checkpoint covers for one parameter."""
        return covered_names(self, f"{prefix}.{leaf}", (None, None))


class SparseMoE(nn.Module):
    """A decoder layer's MoE feed-forward: residual add + RMSNorm, the router, top-k routing, the experts, (the gated
    shared expert), one all-reduce."""

    def __init__(self, spec, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        cfg, hidden = spec.moe, spec.hidden_size
        self.top_k, self.renormalize, self.tp = cfg.top_k, cfg.renormalize, tp
        self.gate = Linear(hidden, cfg.num_experts, bias=False, dtype=dtype)  # the router, on every rank
        self.experts = Experts(cfg.num_experts, hidden, tp.split(cfg.intermediate_size, "moe_intermediate_size"), dtype)
        if cfg.shared_intermediate_size:
            s = tp.split(cfg.shared_intermediate_size, "shared_expert_intermediate_size")
            self.shared_expert = MLP(ColumnParallelLinear(hidden, [s, s], False, dtype),
                                     RowParallelLinear(s, hidden, False, dtype, tp.rank == 0), tp)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                x_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm MoE of a decoder layer: returns (its output, the residual stream); x_norm: x's owed
        post-norm (as MLP.forward)."""
        h, residual = norm(x, residual, x_norm)
        out = self.experts(h, self.gate(h), self.top_k, self.renormalize)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert.partial(h)
        return self.tp.all_reduce(out), residual


def expert_target(parts: list[str]) -> tuple[str, tuple[int | None, int | None]] | None:
    """An HF tensor name (split at dots, from `experts` on) → (our stacked parameter, weight_shard's index); None
    when the name is no expert tensor we know."""
    i = parts.index("experts")
    prefix, rest = ".".join(parts[:i + 1]), parts[i + 1:]
    if len(rest) == 3 and rest[0].isdigit() and rest[2] == "weight" and rest[1] in EXPERT_PROJECTIONS:
        merged, part = EXPERT_PROJECTIONS[rest[1]]
        return f"{prefix}.{merged}", (int(rest[0]), part)
    if len(rest) == 2 and rest[1] == "weight" and rest[0] in EXPERT_PROJECTIONS:
        merged, part = EXPERT_PROJECTIONS[rest[0]]
        return f"{prefix}.{merged}", (None, part)
    if len(rest) == 1 and rest[0] in ("gate_up_proj", "down_proj"):
        return f"{prefix}.{rest[0]}", (None, None)
    return None


def covered_names(experts: Experts, name: str, index: tuple[int | None, int | None]) -> list[str]:
    """The per-expert names that one checkpoint tensor of parameter `name` fills (index (None, None): all of them)."""
    prefix, _, leaf = name.rpartition(".")
    expert, part = index
    if leaf == "down_proj":
        parts = (None,)
    else:
        parts = (0, 1) if part is None else (part,)
    numbers = range(experts.num_experts) if expert is None else (expert,)
    return [f"{prefix}.{e}.{_CANONICAL[leaf, p]}.weight" for e in numbers for p in parts]


__all__ = ["EXPERT_PROJECTIONS", "Experts", "SparseMoE", "covered_names", "expert_target"]
