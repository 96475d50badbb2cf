"""DESIGN.md §9 row 4: weight version switch, trainer step end -> engine on the new version.

Consumes nothing (random weights); prints the time of each part of the switch as the
roles do it, and their sum:

1. trainer: ``state_dict`` cast to the publish dtype + ``save_weights`` (safetensors
   blob, sha256, atomic write) -- trainers/trainer.py ``_publish_weights``;
2. the weights event over Kafka: not timed here (one event; the bus benchmark's
   end-to-end p50 is 5.7-6.6 ms, benchmarks/RESULTS.md);
3. rollout: ``load_verified`` (sha256 of the file, safetensors load) -- what
   ops/role_builders.py's ``load_weights`` does;
4. engine: ``TorchEngine.update_weights`` while it is generating (waits for the step
   boundary, copies into the model).

Qwen2-0.5B shape by default (fp32 master weights on the device, bf16 file), the file in
``--dir`` (default: a temporary directory; the page cache makes the read warm, as it is
when trainer and rollout share a machine). On the GPU box:

    python benchmarks/weight_switch.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_generate import build_model, sync  # noqa: E402

from tapioca.engines.base import GenRequest, SamplingParams  # noqa: E402
from tapioca.engines.torch_engine import TorchEngine  # noqa: E402
from tapioca.models.weight_files import load_verified, save_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="")
    args = ap.parse_args()
    dev = args.device
    trainer_model = build_model(args.tiny, torch.float32, dev)  # fp32 master weights
    engine_model = build_model(args.tiny, torch.bfloat16 if dev.startswith("cuda")
                               else torch.float32, dev)
    publish_dtype = next(engine_model.parameters()).dtype
    engine = TorchEngine(engine_model, device=dev, max_batch_size=64)
    vocab = engine_model.config.vocab_size
    prompts = torch.randint(0, vocab, (64, 64)).tolist()
    stop = threading.Event()

    def keep_generating() -> None:  # the engine is mid-batch when the update arrives
        n = 0
        while not stop.is_set():
            futures = [engine.submit(GenRequest(f"bg{n}:{i}", p, SamplingParams(
                temperature=1.0, max_new_tokens=256))) for i, p in enumerate(prompts)]
            for f in futures:
                f.result()
            n += 1

    bg = threading.Thread(target=keep_generating, daemon=True)
    bg.start()
    time.sleep(2.0)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        for v in range(1, args.repeats + 1):
            path = Path(tmp) / f"v{v:06d}.safetensors"
            sync(dev)
            t0 = time.perf_counter()
            sha, size = save_weights(trainer_model.state_dict(), path, dtype=publish_dtype)
            t1 = time.perf_counter()
            tensors = load_verified(path, sha)
            t2 = time.perf_counter()
            engine.update_weights(tensors, v)
            sync(dev)
            t3 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, size))
            assert engine.version == v
    stop.set()
    engine.shutdown()
    print(f"model: {sum(p.numel() for p in engine_model.parameters()) / 1e6:.1f}M params; "
          f"file {rows[0][4] / 2**20:,.0f} MiB ({publish_dtype}); {dev}; {args.repeats} switches")
    names = ["trainer: cast + save_weights (sha256, write)", "rollout: load_verified (sha256, read)",
             "engine: update_weights mid-generation", "total (plus ~6 ms for the event)"]
    for i, name in enumerate(names):
        vals = [r[i] for r in rows]
        print(f"{name:48s} median {statistics.median(vals):7.3f} s  (all: "
              f"{', '.join(f'{x:.3f}' for x in vals)})")


if __name__ == "__main__":
    main()
