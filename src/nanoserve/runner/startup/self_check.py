"""The start-up self-check: every entry of the graph table (runner/dispatch.py) replayed against the eager work it
stands for, on fresh random inputs, so a graph that does not reproduce its step fails start-up naming itself.

Decode graphs: a probe batch at a random context length, the replayed logits against the eager forward's.
Token-count graphs: a mixed step (decode rows, a chunk after a cached prefix, a fresh prompt, padding), the sampled
rows' logits against the eager forward of the same batch. Sampler graphs: greedy rows (the probe batch samples
nothing, so its temperatures are the padding 0) replayed over the decode graph's logits: each row's token must hold
its row's largest logit (ties may break either way); a verification's over a verification probe (its stores go to the
probe's slots, which a request's prompt step overwrites before any decode row reads them).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.runner.buffers import StepBuffers
from nanoserve.runner.dispatch import GraphTable, Kind
from nanoserve.runner.startup.probes import Probes

CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # max |Δ logit| / max |logit|
WHAT = {Kind.DECODE: "CUDA graph of {} rows", Kind.VERIFY: "CUDA graph of {} rows verifying drafts",
        Kind.DRAFT: "CUDA graph of {} rows (with the draft model)",
        Kind.TOKENS: "CUDA graph of {} tokens (a mixed step)",
        Kind.SAMPLE: "sampler graph of {} rows", Kind.SAMPLE_MASKED: "masked sampler graph of {} rows",
        Kind.SAMPLE_VERIFY: "verification sampler graph of {} rows"}


class GraphCheckError(RuntimeError):
    """A captured graph does not reproduce the eager forward."""


@torch.inference_mode()
def self_check(table: GraphTable, buffers: StepBuffers, probes: Probes, dtype: torch.dtype,
               agree: Callable[[float], float] = float) -> dict[Kind, float]:
    """The worst relative error per kind over every (kind, size) of the table. Raises GraphCheckError naming the
    first beyond the dtype's tolerance. agree: the worst over the tensor-parallel ranks, so they all fail (or pass)
    together."""
    pairs = {Kind.DECODE: _decode_pair, Kind.VERIFY: _decode_pair, Kind.DRAFT: _decode_pair, Kind.TOKENS: _token_pair,
             Kind.SAMPLE: _sample_pair, Kind.SAMPLE_MASKED: _sample_pair, Kind.SAMPLE_VERIFY: _sample_pair}
    worst: dict[Kind, float] = {}
    for kind, size in table.entries():
        graph, ref = pairs[kind](table, buffers, probes, kind, size)
        err = agree(((graph - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        if not err <= CHECK_TOLERANCE[dtype]:  # NaN fails too
            raise GraphCheckError(f"the {WHAT[kind].format(size)} does not reproduce the eager forward (max relative "
                                  f"logit error {err:.3g} > {CHECK_TOLERANCE[dtype]}): a static buffer was replaced "
                                  "or an input is not read from the static buffers; --enforce-eager avoids graphs")
        worst[kind] = max(worst.get(kind, 0.0), err)
    return worst


def _decode_pair(table: GraphTable, buffers: StepBuffers, probes: Probes, kind: Kind, rows: int):
    """A verification graph's over a verification probe (its rows grouped by sequence)."""
    if kind is Kind.VERIFY:
        probes.load_verify(rows)
    else:
        probes.load_decode_check(rows)
    graph = table.replay(kind, rows).float().clone()
    return graph, buffers.decode_forward(rows, propose=kind is Kind.DRAFT, verify=kind is Kind.VERIFY).float()


def _token_pair(table: GraphTable, buffers: StepBuffers, probes: Probes, kind: Kind, tokens: int):
    batch, tail = probes.load_mixed(tokens)
    fwd = buffers.token_forward
    positions = fwd.inputs.views(tokens).positions
    graph = fwd.sample_logits(table.replay(kind, tokens), tail, batch, positions)[0].float().clone()
    return graph, fwd(batch)[0].float()


def _sample_pair(table: GraphTable, buffers: StepBuffers, probes: Probes, kind: Kind, rows: int):
    """(the logit at each row's sampled token, each row's largest logit); a verification's over a verification probe
    (its packed words start with the samples), its logits from the verification graph (a draft model's engine: the
    graph that proposes and verifies, Kind.DRAFT)."""
    forward = Kind.DECODE
    if kind is Kind.SAMPLE_VERIFY:
        probes.load_verify(rows)
        forward = Kind.VERIFY if Kind.VERIFY in table.runners else Kind.DRAFT
    else:
        probes.load_decode_check(rows)
    logits = table.replay(forward, rows).float()
    tokens = table.replay(kind, rows)[:rows].long()
    return logits.gather(1, tokens[:, None])[:, 0], logits.max(dim=1).values


__all__ = ["self_check", "GraphCheckError", "CHECK_TOLERANCE"]
