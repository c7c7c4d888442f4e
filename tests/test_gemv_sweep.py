"""The GEMV sweep of benchmarks/gemv.py: which variants it times and the dispatch table it derives (host-side
logic, no kernel; the sweep itself runs on the GPU)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/

from benchmarks import gemv as sweep  # noqa: E402
from nanoserve.kernels import gemv  # noqa: E402


def test_sweep_times_each_distinct_launch_once():
    for m, want in ((1, {False}), (2, {False, True}), (16, {True}), (64, {True})):
        variants = sweep.configs_for(m, 1024, 2048)
        assert {c.use_dot for c in variants} == want
        keys = [sweep.launch_key(c, m, 1024, 2048, 132) for c in variants]
        assert len(keys) == len(set(keys)), "variants must differ"
        every = {sweep.launch_key(c, m, 1024, 2048, 132) for c in sweep.sweep_configs(m)}
        assert set(keys) == every, "each swept launch is timed once"


def test_shapes_and_compile_jobs():
    shapes = sweep.decode_shapes(["qwen3-0.6b", "smollm2-135m"])
    assert [(s.layer, s.n, s.k) for s in shapes[:5]] == [("qkv", 4096, 1024), ("o_proj", 1024, 2048),
                                                         ("gate_up", 6144, 1024), ("down", 1024, 3072),
                                                         ("lm_head", 151936, 1024)]
    assert (shapes[5].n, shapes[5].k) == (960, 576)  # smollm2 qkv: 9 + 2 * 3 heads of 64
    jobs = sweep.compile_jobs(shapes, [1, 2, 64], 132)
    assert len(jobs) == len(set(jobs)) and all(gemv.GemvConfig.parse(name) for _, _, name, _ in jobs)
    assert {k for _, k, _, _ in jobs} <= {1024, 2048, 3072, 576, 1536} and {size for *_, size in jobs} == {2}
    fp8_jobs = sweep.compile_jobs(sweep.decode_shapes(["qwen3-0.6b"], element_size=1), [1, 64], 132)
    assert {size for *_, size in fp8_jobs} == {1} and any(gemv.GemvConfig.parse(name).block_k == 2048
                                                         for _, _, name, _ in fp8_jobs)  # fp8 tiles: twice the K


def case(m, mib, cublas_us, timings):
    """A measured case: timings maps a config name to µs (the first is the table's variant)."""
    n, k = int(mib * 2**20 / 2 / 1024), 1024
    configs = [{"name": name, "launch_key": list(sweep.launch_key(gemv.GemvConfig.parse(name), m, n, k, 132)),
                "ok": True, "us": us} for name, us in timings.items()]
    best = min(configs, key=lambda c: c["us"])
    return {"m": m, "n": n, "k": k, "weight_bytes": n * k * 2, "cublas": {"us": cublas_us}, "table": configs[0],
            "configs": configs[1:], "best": best}


def test_derived_table_groups_shapes_and_parses():
    a, b = "fma 4x1024 w4 st3 p0", "fma 8x512 w4 st3 p0"
    cases = [case(1, 1, 10.0, {a: 3.0, b: 3.4}), case(1, 4, 10.0, {a: 4.0, b: 4.1}),  # a shared: one entry
             case(1, 32, 20.0, {a: 15.0, b: 10.0}),  # a 50 % slower, b 13 % on the first: a new entry
             case(1, 200, 50.0, {a: 60.0, b: 55.0}),  # cuBLAS wins
             case(2, 8, 5.0, {a: 4.0, b: 4.5})]
    table = sweep.derive_table(cases, 132)
    assert [(cfg, w) for _, cfg, w in table[1]] == [(a, "triton"), (b, "triton"), (b, "cublas")]
    limits = [limit for limit, _, _ in table[1]]
    assert 4 < limits[0] < 32 < limits[1] < 200 and limits[2] is None
    assert table[2] == [(None, a, "triton")]
    source = sweep.table_source(table)
    namespace = {"TRITON": gemv.TRITON, "CUBLAS": gemv.CUBLAS}
    exec(source, namespace)  # noqa: S102 - our own generated source
    parsed = gemv._parsed_table(namespace["GEMV_TABLE"])
    assert parsed[1][0][1] == gemv.GemvConfig.parse(a) and parsed[1][2][2] is False


def test_fp8_prefill_table_is_derived_by_size_and_parses():
    from benchmarks import fp8_prefill
    from nanoserve.kernels import fp8

    def row(tokens, mib, faster):
        return {"tokens": tokens, "weight_bytes": int(mib * 2**20), "faster": faster}
    rows = [row(512, 1, fp8.DEQUANT), row(512, 8, fp8.DEQUANT), row(512, 64, fp8.SCALED_MM),
            row(8192, 1, fp8.SCALED_MM), row(8192, 64, fp8.SCALED_MM)]
    table = fp8_prefill.derive_table(rows)
    assert [m for _, m in table[512]] == [fp8.DEQUANT, fp8.SCALED_MM] and 8 < table[512][0][0] < 64
    assert table[8192] == [(None, fp8.SCALED_MM)]
    namespace = {"SCALED_MM": fp8.SCALED_MM, "DEQUANT": fp8.DEQUANT}
    exec(fp8_prefill.table_source(table), namespace)  # noqa: S102 - our own generated source
    parsed = fp8._parsed_table(namespace["PREFILL_TABLE"])
    assert parsed[512][0][1] == fp8.DEQUANT and parsed[8192][0][1] == fp8.SCALED_MM
