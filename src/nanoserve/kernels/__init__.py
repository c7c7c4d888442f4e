"""Every Triton kernel of nanoserve, each beside its plain-PyTorch reference.

    _triton.py    the triton import guard and shared launch helpers (cdiv, powers of two, SM count, PDL)
    gemv.py       few-row products x @ W.T (+ fused RMSNorm / SiLU-mul prologues); the one place that decides
                  which kernel a linear layer runs
    fp8.py        fp8 (e4m3) weights: quantize / dequantize, the many-rows product (_scaled_mm or dequantize +
                  matmul, PREFILL_TABLE); the few-row product is the GEMV's, which reads fp8 tiles
    fused.py      (owed post-norm +) residual add + RMSNorm, SiLU-and-mul
    moe.py        mixture of experts: the router's top-k, the experts' SwiGLU MLPs on two paths (gemv for decode,
                  sort into expert blocks + grouped GEMM for prefill) and the rule between them
    moe_gemm.py   the grouped GEMM of moe.py's prefill path (SiLU·mul and routing-weight epilogues), its tiles
    rotary_kv.py  per-head q/k RMSNorm + RoPE + KV-cache store (a kernel, or the qkv GEMV's epilogue)
    attention.py  paged attention: backend selection, KV store, split-K decode, paged prefill
    reference.py  plain-PyTorch paged attention (the CPU path and the oracle)
    metadata.py   AttentionInputs, what attention reads besides q/k/v (a Protocol: the dataclass is model/'s)
    ngram.py      the n-gram (prompt lookup) drafts of speculative decoding, from device buffers of token histories
    switches.py   PDL and each fusion on/off (read once from the environment; benchmarks flip them)

Nothing here imports from model/, runner/ or engine/: the model calls down into these, never back.
"""
