"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` shows): the logprob of each prompt
token given the tokens before it, from the prefill's hidden states at the positions before it.

Only requests that ask pay: the prefill normally computes logits at sampled rows only; the rows listed here
get logits too, in chunks of at most `chunk` rows (the sampler's row count, which the memory plan measured),
and leave the device packed into one int32 tensor, copied to host memory without blocking and read with the
step's sampled tokens.
"""
from __future__ import annotations

import numpy as np
import torch


@torch.inference_mode()
def compute(model, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int,
            chunk: int) -> torch.Tensor:
    """[target logprob | top-k ids | top-k logprobs] per row, as int32 words (floats as their bits)."""
    parts_lp, parts_ids, parts_vals = [], [], []
    for at in range(0, rows.numel(), chunk):
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows[at:at + chunk].long()]).float(), dim=-1)
        parts_lp.append(logprobs.gather(1, targets[at:at + chunk].long()[:, None])[:, 0])
        if k:
            vals, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
            parts_ids.append(ids.to(torch.int32).flatten())
            parts_vals.append(vals.flatten())
    words = [torch.cat(parts_lp).view(torch.int32)]
    if k:
        words += [torch.cat(parts_ids), torch.cat(parts_vals).view(torch.int32)]
    return torch.cat(words)


class PromptLogprobsHandle:
    """One step's prompt logprobs on their way to host memory."""

    def __init__(self, packed: torch.Tensor, num_rows: int):
        on_cuda = packed.is_cuda
        self.host = torch.empty(packed.numel(), dtype=torch.int32, pin_memory=on_cuda)
        self.host.copy_(packed, non_blocking=on_cuda)
        self.event = None
        if on_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.num_rows = num_rows

    def result(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """(the token's logprob, its top-k (id, logprob) pairs) per row, in row order."""
        if self.event is not None:
            self.event.synchronize()
        words, n = self.host.numpy(), self.num_rows
        k = (len(words) - n) // (2 * n) if n else 0
        floats = words.view(np.float32)
        lps = floats[:n].tolist()
        ids = words[n:n + n * k].reshape(n, k).tolist()
        vals = floats[n + n * k:n + 2 * n * k].reshape(n, k).tolist()
        return [(lp, list(zip(i, v))) for lp, i, v in zip(lps, ids, vals)]
