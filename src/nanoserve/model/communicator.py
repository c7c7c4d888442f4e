"""Tensor parallelism's communicator: this rank's place in the group, the collectives over it, and how the
ranks share a dimension (Megatron-style: see the sharded layers in model/layers.py).

Every rank holds a slice of each matrix. qkv and gate_up are split by output rows (column-parallel: no
communication); o_proj and down_proj by input columns (row-parallel: each rank's product is a partial sum,
and one all-reduce gives every rank the full row that the next GEMV's fused norm prologue reads). The
embedding is split over the vocabulary (a masked lookup + all-reduce), so is the lm_head (logits are
all-gathered, every rank samples from the full row). KV heads follow the query heads that read them: split
when there are at least as many as ranks, each replicated on the ranks of its query group otherwise.
With one rank every collective is the identity: the same layers serve tensor_parallel_size=1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class TensorParallel:
    """This rank's place in the tensor-parallel group and the collectives over it.

    `group` is a torch.distributed backend object (ProcessGroupNCCL on CUDA, ProcessGroupGloo on CPU) that
    the runner built for this engine alone: no process-wide default group. The device collectives are
    graph-capturable on NCCL and synchronous (asyncOp off, as torch.distributed.all_reduce sets it), so NCCL
    runs them on the current stream: no fork and join with its own stream around each one. The host helpers
    (min/max/broadcast) let the ranks agree on start-up values."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, device: torch.device | None = None):
        if size > 1 and group is None:
            raise ValueError(f"tensor parallelism over {size} ranks needs a process group")
        self.rank, self.size, self.group = rank, size, group
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._sum, self._gather = _sync(dist.AllreduceOptions()), _sync(c10d.AllgatherOptions())

    def split(self, full: int, name: str) -> Split:
        """This rank's equal share of `full` rows; ValueError when the ranks cannot share them evenly."""
        if full % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {name}={full}")
        n = full // self.size
        return Split(full, self.rank * n, (self.rank + 1) * n)

    # -- device collectives (the forward) ---------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a row-parallel layer's partial products)."""
        if self.size > 1:
            self.group.allreduce([x], self._sum).wait()
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[n, c] per rank → [n, size × c], rank r's columns at r × c (vocab-parallel logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty(self.size * x.shape[0], x.shape[1])
        self.group._allgather_base(out, x, self._gather).wait()
        return out.view(self.size, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], -1)

    # -- host agreement (start-up) ----------------------------------------------------------------
    def min_int(self, value: int) -> int:
        return int(self._reduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MIN).item())

    def max_float(self, value: float) -> float:
        return float(self._reduce(torch.tensor([value], dtype=torch.float64), dist.ReduceOp.MAX).item())

    def broadcast_ints(self, values: list[int], capacity: int) -> list[int]:
        """Rank 0's list of at most `capacity` ints, on every rank (the others' `values` are ignored)."""
        if self.size == 1:
            return list(values)
        buf = torch.zeros(capacity + 1, dtype=torch.int64)
        if self.rank == 0:
            if len(values) > capacity:
                raise ValueError(f"{len(values)} values do not fit a broadcast of {capacity}")
            buf[0] = len(values)
            buf[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        buf = buf.to(self.device)
        opts = _sync(dist.BroadcastOptions())
        opts.rootRank = 0
        self.group.broadcast([buf], opts).wait()
        buf = buf.cpu()
        return buf[1:1 + int(buf[0])].tolist()

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.size == 1:
            return t
        t = t.to(self.device)
        opts = _sync(dist.AllreduceOptions())
        opts.reduceOp = op
        self.group.allreduce([t], opts).wait()
        return t.cpu()


def _sync(options):
    """Collective options with asyncOp off where this torch has it (older ones always use NCCL's stream)."""
    if hasattr(options, "asyncOp"):
        options.asyncOp = False
    return options


@dataclass(frozen=True)
class Split:
    """This rank's rows [start, stop) of a dimension of `full` rows."""

    full: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, factor: int) -> Split:
        """The same split in units `factor` times smaller (heads → rows of head_dim each)."""
        return Split(self.full * factor, self.start * factor, self.stop * factor)


def kv_head_split(num_kv_heads: int, tp: TensorParallel) -> Split:
    """The KV heads this rank's query heads read: an equal share, or the one head its query group shares."""
    if num_kv_heads >= tp.size:
        return tp.split(num_kv_heads, "num_key_value_heads")
    head = tp.rank // (tp.size // num_kv_heads)
    return Split(num_kv_heads, head, head + 1)


def check_sharding(spec, size: int) -> None:
    """ValueError naming the first model dimension that `size` ranks cannot share (spec: a ModelSpec)."""

    def divides(name: str, value: int) -> None:
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {name}={value}")

    if size > 1 and spec.qk_norm == "projection":  # its norm reads every head: the ranks would all-reduce per layer
        raise ValueError(f"tensor_parallel_size={size}: {spec.architecture} (q/k RMSNorm over the whole projection) "
                         "runs on one rank only")
    divides("num_attention_heads", spec.num_heads)
    if spec.num_kv_heads >= size:
        divides("num_key_value_heads", spec.num_kv_heads)
    elif size % spec.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} is not a multiple of num_key_value_heads="
                         f"{spec.num_kv_heads}: with fewer KV heads than ranks, each head is replicated on a whole "
                         "number of ranks")
    moe = spec.moe
    if moe is None or not all(moe.sparse_layers):  # some layers keep the dense MLP
        divides("intermediate_size", spec.intermediate_size)
    if moe is not None:  # experts are split like dense MLPs: each rank holds a slice of every expert
        divides("moe_intermediate_size", moe.intermediate_size)
        if moe.shared_intermediate_size:
            divides("shared_expert_intermediate_size", moe.shared_intermediate_size)
    divides("vocab_size", spec.vocab_size)


__all__ = ["TensorParallel", "Split", "kv_head_split", "check_sharding"]
