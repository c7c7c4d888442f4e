"""Where the W8A8 GEMV's GPU results leave the fp32 reference: quantization (the GPU's codes vs the CPU's), our
kernel on FP8 tensor cores, the same kernel with the products in fp32 (DOT_IN_FP32), and cuBLAS's FP8 tensor cores
(torch._scaled_mm per 128-column group) on the same codes. Writes $OUT/w8a8_outliers.json."""
import json, os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import torch.nn.functional as F
from nanoserve.kernels import fp8, gemv
from nanoserve.kernels.gemv import GemvConfig

CASES = [(64, 37, 200, "dot8q 64x128 w4 st3 p0"), (16, 150, 320, "dot8q 16x32 w4 st2 s3"),
         (33, 37, 200, "dot8q 16x32 w4 st2 s3"), (64, 4096, 4096, "dot8q 128x128 w4 st4 p1"),
         (8, 4096, 14336, "dot8q 128x128 w4 st4 p1")]


def fp32_dot(flag):
    orig = gemv._gemv_kernel

    class K:
        def __getitem__(self, grid):
            f = orig[grid]
            return lambda *a, **kw: f(*a, **{**kw, "DOT_IN_FP32": flag})
    return orig, K()


def scaled_mm_groups(codes, xs, q, s):
    """Σ_g (codes_g @ q_g.T on cuBLAS FP8, fp32 out) · xs[:, g] · s: the same codes through cuBLAS."""
    m, k = codes.shape
    n = q.shape[0]
    pn, pm = -n % 16, -m % 16
    total = torch.zeros(m, n, device="cuda")
    one = torch.ones((), device="cuda")
    for g in range(0, k, 128):
        a = codes[:, g:g + 128].float()
        b = q[:, g:g + 128].float()
        kk = a.shape[1] + (-a.shape[1] % 16)
        a = F.pad(a, (0, kk - a.shape[1], 0, pm)).to(fp8.FP8_DTYPE)
        b = F.pad(b, (0, kk - b.shape[1], 0, pn)).to(fp8.FP8_DTYPE)
        part = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)[:m, :n]
        total += part * xs[:, g // 128, None]
    return total * s[None, :]


report = {}
for m, n, k, cfg in CASES:
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    q, s = fp8.quantize(w)
    w_ref = fp8.dequantize(q, s)
    xq_cpu, xs_cpu = fp8.quantize_groups(x.float(), 128)
    want = F.linear(fp8.dequantize_groups(xq_cpu, xs_cpu, 128), w_ref)
    products = (fp8.dequantize_groups(xq_cpu, xs_cpu, 128)[:, None, :] * w_ref[None]).abs().sum(-1)
    xc, qc, sc = x.cuda(), q.cuda(), s.cuda()
    rows = fp8.quantize_activations(xc)
    rec = {"codes_differ": int((rows.codes.cpu().float() != xq_cpu.float()).sum()),
           "scales_differ": int((rows.scales.cpu() != xs_cpu).sum())}
    config = GemvConfig.parse(cfg)
    results = {"triton_fp8": gemv._launch(rows, qc, None, k, config, weight_scale=sc)}
    orig, patched = fp32_dot(True)
    gemv._gemv_kernel = patched
    try:
        results["triton_fp32_products"] = gemv._launch(rows, qc, None, k, config, weight_scale=sc)
    except Exception as exc:
        rec["triton_fp32_products"] = repr(exc)[:300]
    finally:
        gemv._gemv_kernel = orig
    try:
        results["cublas_fp8_groups"] = scaled_mm_groups(rows.codes, rows.scales, qc, sc)
    except Exception as exc:
        rec["cublas_fp8_groups"] = repr(exc)[:300]
    scale = want.abs().max().item()
    for name, out in results.items():
        err = (out.float().cpu() - want).abs()
        i = int(err.argmax())
        r, c = divmod(i, n)
        rec[name] = {"max_err_of_max_out": err.max().item() / scale, "rel_norm": (err.norm() / want.norm()).item(),
                     "over_1pct": int((err > 0.01 * scale).sum()), "worst": [r, c],
                     "worst_out": want[r, c].item(), "worst_sum_abs_products": products[r, c].item(),
                     "err_over_sum_abs_products": (err / products).max().item()}
    report[f"m={m} {n}x{k} {cfg}"] = rec
    print(f"== outliers m={m} {n}x{k}: " + json.dumps(rec), flush=True)
out = os.environ.get("OUT")
if out:
    Path(out, "w8a8_accuracy.json").write_text(json.dumps(report, indent=1))
