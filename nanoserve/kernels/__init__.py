"""Every Triton kernel of nanoserve, each beside its plain-PyTorch reference.

    _triton.py    the triton import guard and shared launch helpers (cdiv, powers of two, SM count)
    gemv.py       few-row products x @ W.T (+ fused RMSNorm / SiLU-mul prologues); the one place that
                  decides which kernel a linear layer runs
    fused.py      residual add + RMSNorm, SiLU-and-mul
    rotary_kv.py  per-head q/k RMSNorm + RoPE + KV-cache store
    attention.py  paged attention: backend selection, KV store, split-K decode, paged prefill
    reference.py  plain-PyTorch paged attention (the CPU path and the oracle)
    metadata.py   AttentionMetadata, what attention needs besides q/k/v

Nothing here imports from model/, runner/ or engine/: the model calls down into these, never back.
"""
