"""One decode attention call of a grouped-query model, two ways (why engines/attention.py).

Consumes nothing (random tensors); prints microseconds per layer call for
(a) transformers' path with a padding mask: ``repeat_kv`` (copying the KV cache
``Hq / Hkv`` times), then SDPA, and (b) SDPA with ``enable_gqa=True`` on the KV heads,
plus the largest difference between the two outputs. Default shape: Qwen2-0.5B's
decode (256 rows, 14 query / 2 KV heads, head dim 64, 256 keys, bf16), keys viewed
out of a larger cache buffer as the engine's cache does. On the GPU box:

    python benchmarks/gqa_attention.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def repeat_kv(x_BHKD: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' repeat_kv: what its sdpa path runs with a padding mask."""
    b, h, k, d = x_BHKD.shape
    return x_BHKD[:, :, None].expand(b, h, groups, k, d).reshape(b, h * groups, k, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--q-heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    dev, groups = args.device, args.q_heads // args.kv_heads
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    q = torch.randn(args.rows, args.q_heads, 1, args.head_dim, device=dev, dtype=dtype)
    cache = torch.randn(2, args.rows, args.kv_heads, 2 * args.keys, args.head_dim, device=dev,
                        dtype=dtype)
    k, v = cache[0, :, :, :args.keys], cache[1, :, :, :args.keys]
    mask = torch.ones(args.rows, 1, 1, args.keys, device=dev, dtype=torch.bool)
    mask[:, :, :, : args.keys // 10] = False  # some left padding

    def repeated() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                              attn_mask=mask)

    def gqa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    for name, fn in [("repeat_kv + sdpa (transformers, masked)", repeated),
                     ("sdpa enable_gqa (engines/attention.py)", gqa)]:
        for _ in range(5):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        sync()
        print(f"{name}: {(time.perf_counter() - t0) / args.calls * 1e6:,.1f} us per layer call")
    print(f"max |difference|: {(repeated() - gqa()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
