"""The static-address experiment: why a CUDA graph needs fixed input/output buffers.

A tiny fp32 block (relu(x @ w1) @ w2 + x, width 128) is warmed up on a side stream, captured
once, and then fed new data only through `static_input.copy_(...)` before each `replay()`.
The script checks that

  * replay after copy_ gives the eager result (assert_close),
  * the input and output `data_ptr()`s never move, however many replays run,
  * a copy_ of a different shape is refused with a RuntimeError (a graph has one shape),

and times eager vs copy_ + replay. Two small matmuls are almost pure launch overhead, so the
gap is the host-side cost a graph removes; it is not the speed-up of a whole model.

    python examples/cuda_graph_reference.py [--json PATH] [--rounds N]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

WIDTH = 128
DTYPE = torch.float32


class TinyBlock:
    """relu(x @ w1) @ w2 + x: four short kernels, enough to show launch cost."""

    def __init__(self, width: int, device: torch.device, generator: torch.Generator) -> None:
        scale = width**-0.5
        self.w1 = torch.randn(width, width, generator=generator, dtype=DTYPE).to(device) * scale
        self.w2 = torch.randn(width, width, generator=generator, dtype=DTYPE).to(device) * scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1) @ self.w2 + x


def host_median_us(fn, warmup: int, rounds: int) -> float:
    """Median wall time of fn() in µs; synchronize after each round so every sample covers
    launch + GPU execution of exactly one call (host timing, perf_counter)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def run(rounds: int, warmup: int) -> dict:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(83)
    block = TinyBlock(WIDTH, device, gen)
    first = torch.randn(1, WIDTH, generator=gen, dtype=DTYPE).to(device)

    # Warm-up on a side stream: cuBLAS handles, workspaces and allocator blocks are created
    # here, not inside the capture (an allocation during capture would be baked into the graph).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            block(first)
    torch.cuda.current_stream().wait_stream(side)

    # The static input is the graph's one "socket": its address and shape are recorded.
    static_input = first.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = block(static_input)
    input_ptr, output_ptr = static_input.data_ptr(), static_output.data_ptr()

    # New data goes in by copy_ (same storage), never by rebinding the name.
    fresh = torch.randn(1, WIDTH, generator=gen, dtype=DTYPE).to(device)
    eager = block(fresh)
    static_input.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(static_output, eager, rtol=1e-5, atol=1e-6)
    max_abs_diff = (static_output - eager).abs().max().item()

    eager_us = host_median_us(lambda: block(fresh), warmup, rounds)

    def copy_and_replay() -> None:
        static_input.copy_(fresh)
        graph.replay()

    replay_us = host_median_us(copy_and_replay, warmup, rounds)

    # After warmup + rounds replays the socket and the output are still where capture put them.
    assert static_input.data_ptr() == input_ptr, "static input moved"
    assert static_output.data_ptr() == output_ptr, "static output moved"
    torch.testing.assert_close(static_output, eager, rtol=1e-5, atol=1e-6)

    try:
        static_input.copy_(torch.randn(2, WIDTH, device=device, dtype=DTYPE))
        rejected = None
    except RuntimeError as error:
        rejected = type(error).__name__
        reason = str(error).splitlines()[0]
    if rejected is None:
        raise AssertionError("a [2, 128] copy_ into the [1, 128] static input was accepted")

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "dtype": str(DTYPE).replace("torch.", ""),
        "shape": list(static_input.shape),
        "input_ptr_static": input_ptr,
        "output_ptr_static": output_ptr,
        "replays": warmup + rounds + 1,
        "max_abs_diff": max_abs_diff,
        "eager_median_us": eager_us,
        "copy_plus_graph_replay_median_us": replay_us,
        "speedup": eager_us / replay_us,
        "timing": f"host perf_counter, synchronize after each call, median of {rounds} after {warmup} warm-up",
        "dynamic_shape_rejected": rejected,
        "dynamic_shape_error": reason,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    parser.add_argument("--rounds", type=int, default=200, help="timed calls per variant (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls before timing (default 20)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(f"cuda_graph_reference: CUDA is not available (torch={torch.__version__}), "
              "so there is no graph to capture.")
        print("On a GPU it captures a tiny fp32 block, checks replay == eager and that the static input/output "
              "data_ptr()s never move, and prints eager vs copy_ + graph replay median latency.")
        return 0

    with torch.inference_mode():
        r = run(args.rounds, args.warmup)
    print(f"python={r['python']} torch={r['torch']}")
    print(f"device={r['device']} dtype={r['dtype']} shape={tuple(r['shape'])}")
    print(f"input_ptr_static={r['input_ptr_static']} output_ptr_static={r['output_ptr_static']} replays={r['replays']}")
    print(f"max_abs_diff={r['max_abs_diff']:.3e}")
    print(f"timing: {r['timing']}")
    print(f"eager_median_us={r['eager_median_us']:.3f}")
    print(f"copy_plus_graph_replay_median_us={r['copy_plus_graph_replay_median_us']:.3f}")
    print(f"speedup={r['speedup']:.2f}x")
    print(f"dynamic_shape_rejected={r['dynamic_shape_rejected']} ({r['dynamic_shape_error']})")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
