"""`nanoserve bench latency | throughput | serve | graphs`: the user-facing benchmarks, in `vllm bench`'s vocabulary.

common.py: the workload (random token ids, ShareGPT files), Poisson arrivals, percentiles, the JSON record;
offline.py: latency and throughput through the offline LLM; serve.py: the streaming load generator and its
figures; graphs.py (with padding.py, decode_step.py): the CUDA-graph size report; cli.py: the flags.
"""
