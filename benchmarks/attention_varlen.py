"""Packed-sequence causal attention of the training step, forward + backward, per backend
(models/attention.py): flash-attention 2 varlen (``varlen``, today's ``auto``) against
cuDNN's fused ragged attention (``cudnn``), side by side in one process.

Consumes nothing (random tensors); prints milliseconds per layer call (forward +
backward) and each backend's largest error against the fp32 ``sdpa`` reference, and
writes ``$OUT/attention_varlen.json``. Shapes: Qwen2-0.5B (14 / 2 heads, dim 64),
Qwen2.5-1.5B (12 / 2, dim 128), Qwen2-7B (28 / 4, dim 128); batches: 8 x 2048 tokens and
a heavy-tailed 16k-token batch (lengths 64..8192). On the GPU box (~1 minute):

    python benchmarks/attention_varlen.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tapioca.models.attention import (  # noqa: E402
    cudnn_attention, packed_seqs, probe_cudnn, probe_varlen, sdpa_attention, varlen_attention)

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}


def batches(seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    tail, total = [], 0
    while total < 16384:
        n = int(min(8192, max(64, 64 * float(torch.empty(1).exponential_(1.0 / 8, generator=gen)))))
        n = min(n, 16384 - total) if 16384 - total >= 64 else 16384 - total
        tail.append(n)
        total += n
    return {"8x2048": [2048] * 8, "tail16k": tail}


def time_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def diagnose() -> None:
    """Why ``cudnn`` fails here: the forward's output shapes, the backward with each way of
    saying "no bias", and SDPA's own nested-tensor path pinned to cuDNN."""
    import traceback

    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt, h, d = "cuda", torch.bfloat16, 4, 64
    seqs = packed_seqs([37, 5, 64], dev)
    n = seqs.n_tokens
    q, k, v, g = (torch.randn(n, h, d, device=dev, dtype=dt) for _ in range(4))
    cu, m = seqs.cu_seqlens_S1, seqs.max_len
    res = torch.ops.aten._cudnn_attention_forward(
        query=q, key=k, value=v, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=m, max_k=m,
        compute_log_sumexp=True, dropout_p=0.0, is_causal=True, return_debug_mask=False, scale=d ** -0.5)
    print("forward outputs:", [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in res])
    for label, bias in [("empty(0)", torch.empty(0, device=dev, dtype=dt)),
                        ("empty(0,0,0,0)", torch.empty(0, 0, 0, 0, device=dev, dtype=dt)),
                        ("zeros(1,1,1,1)", torch.zeros(1, 1, 1, 1, device=dev, dtype=dt))]:
        try:
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                grad_out=g, query=q, key=k, value=v, out=res[0], logsumexp=res[1], philox_seed=res[6],
                philox_offset=res[7], attn_bias=bias, cum_seq_q=cu, cum_seq_k=cu, max_q=m, max_k=m,
                dropout_p=0.0, is_causal=True, scale=d ** -0.5)
            print("backward with", label, "ok", tuple(dq.shape))
        except Exception:  # noqa: BLE001 -- the diagnosis is the traceback
            print("backward with", label, "failed:", traceback.format_exc(limit=2)[-600:])
    try:
        offsets = cu.long()
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(x.detach().clone().requires_grad_(), offsets)
                      .transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
        out.transpose(1, 2).values().backward(g)
        print("nested-tensor SDPA pinned to cuDNN: ok", tuple(out.transpose(1, 2).values().shape))
    except Exception:  # noqa: BLE001
        print("nested-tensor SDPA pinned to cuDNN failed:", traceback.format_exc(limit=3)[-800:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--diagnose", action="store_true", help="why the cudnn backend fails here")
    args = ap.parse_args()
    if args.diagnose:
        return diagnose()
    dev, dt = "cuda", torch.bfloat16
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    rows, results = [], []
    for shape, (h, kv, d) in SHAPES.items():
        can = {"varlen": probe_varlen(dev, dt, h, kv, d) == "gqa", "cudnn": probe_cudnn(dev, dt, h, kv, d)}
        for bname, lengths in batches(0).items():
            seqs = packed_seqs(lengths, dev)
            n = seqs.n_tokens
            gen = torch.Generator(device=dev).manual_seed(1)
            q = torch.randn(n, h, d, device=dev, dtype=dt, generator=gen).requires_grad_()
            k = torch.randn(n, kv, d, device=dev, dtype=dt, generator=gen).requires_grad_()
            v = torch.randn(n, kv, d, device=dev, dtype=dt, generator=gen).requires_grad_()
            g = torch.randn(n, h, d, device=dev, dtype=dt, generator=gen)
            scale = d ** -0.5
            ref = ref_grads = None
            if shape != "7b":  # fp32 padded reference: memory grows with S * max_len^2
                ref = sdpa_attention(q.float(), k.float(), v.float(), seqs, scale)
                ref_grads = torch.autograd.grad(ref, (q, k, v), g.float())
            fns = {"varlen": lambda: varlen_attention(q, k, v, seqs, scale),
                   "cudnn": lambda: cudnn_attention(q, k, v, seqs, scale)}
            times = {}
            for name, fn in fns.items():
                if not can[name]:
                    results.append({"shape": shape, "batch": bname, "backend": name, "error": "probe failed"})
                    continue
                try:
                    def step(fn=fn):
                        out = fn()
                        torch.autograd.grad(out, (q, k, v), g)
                    step()
                    ms = time_ms(step, args.reps)
                    fwd_ms = time_ms(lambda fn=fn: fn().detach(), args.reps)
                    err = None
                    if ref is not None:
                        out = fn()
                        grads = torch.autograd.grad(out, (q, k, v), g)
                        err = max(float((a.float() - b).abs().max() / (b.abs().max() + 1e-6))
                                  for a, b in zip((out, *grads), (ref, *ref_grads)))
                    times[name] = ms
                    results.append({"shape": shape, "batch": bname, "backend": name, "fwd_bwd_ms": round(ms, 3),
                                    "fwd_ms": round(fwd_ms, 3), "max_rel_err_vs_fp32": err})
                except Exception as e:  # noqa: BLE001 -- a failing backend is a result
                    results.append({"shape": shape, "batch": bname, "backend": name,
                                    "error": f"{type(e).__name__}: {e}"[:300]})
            for r in results[-len(fns):]:
                ratio = (times["varlen"] / times[r["backend"]]) if r["backend"] in times and "varlen" in times else None
                rows.append((shape, bname, r["backend"], r.get("fwd_ms"), r.get("fwd_bwd_ms"),
                             r.get("max_rel_err_vs_fp32"), ratio, r.get("error", "")))
            del q, k, v, g, ref, ref_grads
            torch.cuda.empty_cache()
    print(f"{'shape':6} {'batch':8} {'backend':7} {'fwd ms':>8} {'fwd+bwd':>8} {'err':>9} {'speedup':>8}")
    for s, b, name, f, fb, e, r, err in rows:
        fmt = lambda x, p: "-" if x is None else f"{x:{p}}"  # noqa: E731
        print(f"{s:6} {b:8} {name:7} {fmt(f, '8.3f')} {fmt(fb, '8.3f')} {fmt(e, '9.2e')} {fmt(r, '8.2f')} {err[:80]}")
    print("ms per layer call (median); speedup = varlen time / this backend's (fwd+bwd); err = largest "
          "relative error of out/dq/dk/dv against the fp32 sdpa reference")
    out = args.out or (os.path.join(os.environ["OUT"], "attention_varlen.json") if os.environ.get("OUT") else "")
    if out:
        Path(out).write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
