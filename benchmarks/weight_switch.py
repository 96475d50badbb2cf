"""The weight switch row of docs/design.md#9-performance-targets: weight version switch,
trainer step end -> engine generating on the new version, for every transport side by
side in one invocation.

Consumes nothing (random weights); prints a table and writes ``$OUT/weight_switch.json``
(or ``--out``). Each variant runs ``--repeats`` switches while the engine generates in
the background (the switch lands mid-batch, at a decode-step boundary, as in the rollout
worker). Timestamps cross processes (``time.monotonic``, one clock per host). Parts:

- publish: the trainer's side, from the end of its step (weights updated, device
  synchronised) to the weights event's bytes being ready (weights/publisher.py);
- handoff: the event from the trainer process to the engine's (a pipe here) and decoded;
  the Kafka hop is NOT included (bus benchmark: p50 2-7 ms, docs/kafka-clients.md);
- fetch: the receiver's copy of the bytes into its buffer and the checksum check
  (weights/receiver.py); for file: reading the file and its sha256;
- update: ``TorchEngine.update_weights``: waiting for the running decode step to end, then
  the copy into the parameters; ``stall`` is the copy alone, the time generation stops.

Variants:

1. ``file (before)``: the path before issue 15, in one process: ``save_weights`` (per-tensor
   cast + host copy, safetensors blob, sha256, write), then the old reader (sha256 of the
   file, then ``load_file``). 0.5B shape.
2. ``file``: the file transport now, in one process: pack on the GPU, one device-to-host
   copy, write + sha256 in one pass; the reader maps the file once (sha256, tensors on the
   same pages). 0.5B.
3. ``ipc``: the trainer in its own process (its own CUDA context, as in a run), the engine
   in this one: CUDA IPC handle of a double-buffered bf16 flat buffer, mapped once. 0.5B
   (fp32 master weights; the durable file of every version written in the background,
   its write time reported) and 7B (Qwen2-7B shape, untied; bf16 trainer weights WITHOUT
   optimizer state: trainer 15.2 GB + 2 x 15.2 GB buffers, engine 15.2 GB + its 15.2 GB
   receive buffer, ~77 GB in all; no durable files, 15 GB each).
4. ``nccl (gloo, CPU)``: the nccl transport's code with the gloo backend: a trainer process
   and two receiver processes on CPU, 0.5B shape; done = both receivers verified and
   copied the version into their (CPU) parameters.
5. ``nccl (2 GPUs)``: only when two GPUs are visible: trainer on cuda:0, engine on cuda:1.

On the GPU box (about 3 minutes; runs every variant):

    python benchmarks/weight_switch.py --device cuda

CPU self-check of every code path (tiny shapes, shm instead of CUDA IPC, ~1 min):
``python benchmarks/weight_switch.py --device cpu --tiny``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tapioca.engines.base import GenRequest, SamplingParams  # noqa: E402
from tapioca.engines.torch_engine import TorchEngine  # noqa: E402
from tapioca.models.factory import build_tiny_model  # noqa: E402

SHAPES = {
    # Qwen2-0.5B / Qwen2-7B published shapes.
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, tie=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
               num_heads=28, num_kv_heads=4, tie=False),
    # --tiny stand-ins, same code paths.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, tie=True),
    "tiny-big": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4,
                     num_heads=4, num_kv_heads=2, tie=False),
}
TARGET_S = {"0.5b": 0.1, "7b": 0.3}
BUCKET_BYTES = 256 << 20


def build(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Random weights, allocated and initialised on ``device`` directly (a 7B model built
    on the CPU first would take minutes)."""
    s = dict(SHAPES[shape])
    vocab, tie = s.pop("vocab_size"), s.pop("tie")
    # device= matters: build_tiny_model's own device context (default "cpu") wins over an
    # outer one, and a 7B model initialised on the host took minutes (the 7B runs that
    # hung past their stage limits).
    model = build_tiny_model(vocab, seed=0, dtype=dtype, tie_word_embeddings=tie,
                             max_position_embeddings=4096, device=device, **s)
    model.set_attn_implementation("sdpa")
    return model.to(device)


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def perturb(model: torch.nn.Module, v: int) -> None:
    """Stands in for an optimizer step: every version has other bytes."""
    with torch.no_grad():
        torch._foreach_add_([p for p in model.parameters()], 1e-3 * (1 + v % 3))


def gib(n: int) -> float:
    return round(n / 2**30, 3)


# ---------------------------------------------------------------------- the engine side

class Generating:
    """Keeps ``engine`` busy: batches of random prompts, back to back, in a thread."""

    def __init__(self, engine: TorchEngine, vocab: int, n_seqs: int, prompt_len: int,
                 new_tokens: int) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.prompts = torch.randint(0, vocab, (n_seqs, prompt_len)).tolist()
        self.new_tokens = new_tokens
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.errors: list[BaseException] = []

    def _run(self) -> None:
        n = 0
        try:
            while not self.stop.is_set():
                fs = [self.engine.submit(GenRequest(f"bg{n}:{i}", p, SamplingParams(
                    temperature=1.0, max_new_tokens=self.new_tokens)))
                      for i, p in enumerate(self.prompts)]
                for f in fs:
                    f.result()
                n += 1
        except BaseException as exc:  # shown in the variant's error
            self.errors.append(exc)

    def __enter__(self) -> "Generating":
        self.thread.start()
        time.sleep(1.0)  # mid-batch when the first update arrives
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()


def timed_copies(engine: TorchEngine) -> list[float]:
    """Wraps the engine's in-place copy (benchmark only): the seconds generation stops."""
    copies: list[float] = []
    inner = engine._load_state_dict

    def timed(state_dict) -> None:
        t = time.monotonic()
        inner(state_dict)
        copies.append(time.monotonic() - t)

    engine._load_state_dict = timed  # type: ignore[method-assign]
    return copies


def engine_matches(engine: TorchEngine, event, device: str) -> bool:
    """The engine's parameters, packed with the event's layout, have the trainer's
    checksums: bit for bit what the trainer sent."""
    from tapioca.weights.layout import Layout, bucket_checksums

    layout = Layout.from_event(event.tensors)
    buf = torch.zeros(layout.padded_bytes, dtype=torch.uint8, device=device)
    own = engine.model.state_dict()
    layout.pack(buf, [own[e.name] for e in layout.entries])
    ok = bucket_checksums(buf, layout.padded_bytes, event.bucket_bytes) == event.bucket_checksums
    del buf
    return ok


# ---------------------------------------------------------------------- trainer process

def trainer_proc(conn, cfg: dict) -> None:
    """A trainer: builds the model, publishes a version on each "go"."""
    try:
        from tapioca.schemas.envelope import encode_event
        from tapioca.schemas.events import WeightsEvent
        from tapioca.weights import WeightPublisher

        torch.set_num_threads(cfg.get("threads", 4))
        device = cfg["device"]
        if device.startswith("cuda"):  # "cuda" names no index: set_device needs one
            torch.cuda.set_device(torch.device(device).index or 0)
        model = build(cfg["shape"], getattr(torch, cfg["master_dtype"]), device)
        pub = WeightPublisher(cfg["transport"], cfg["dir"], device=device,
                              publish_dtype=getattr(torch, cfg["publish_dtype"]),
                              bucket_bytes=cfg["bucket_bytes"], buffer_slots=2,
                              file_every_versions=cfg["file_every"], keep_versions=2,
                              transfer_timeout_s=120.0)
        conn.send(("ready", sum(p.numel() for p in model.parameters())))
        v, files = 0, []
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            v = msg[1]
            perturb(model, v)
            sync(device)
            t0 = time.monotonic()  # the trainer's step has ended
            fields = pub.publish(model.state_dict(), v)
            payload = encode_event(WeightsEvent(version=v, **fields), max_bytes=64 << 20)
            t1 = time.monotonic()
            conn.send(("event", t0, t1, payload))
            files += pub.poll()  # starts the background file of this version (after its event)
        files += pub.finish(v)
        conn.send(("done", {"durable_files": len(files), "durable_write_s": pub.writer.last_write_s,
                            "durable_skipped": pub.writer.skipped,
                            "nccl_served": getattr(pub.server, "served", None)}))
        pub.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def receiver_proc(conn, member: str) -> None:
    """A CPU rollout stand-in for the gloo variant: fetch, verify, copy into its own
    parameters (allocated from the first event's layout)."""
    try:
        from tapioca.schemas.envelope import decode_event
        from tapioca.weights import WeightReceiver

        torch.set_num_threads(4)
        rec = WeightReceiver("cpu", member=member)
        params = None
        conn.send(("ready",))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            t2 = time.monotonic()
            event = decode_event(msg[1], max_bytes=64 << 20)
            views = rec.fetch(event)
            t3 = time.monotonic()
            if params is None:
                params = {k: torch.empty_like(v) for k, v in views.items()}
            for k, v in views.items():
                params[k].copy_(v)
            t4 = time.monotonic()
            conn.send(("done", t2, t3, t4))
        rec.close()
        conn.send(("bye", rec.fast_loads))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _recv(conn, timeout_s: float = 600.0):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from a child process in {timeout_s:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("child process failed:\n" + msg[1])
    return msg


# ---------------------------------------------------------------------- variants

def summarise(name: str, shape: str, nbytes: int, rows: list[dict], extra: dict | None = None) -> dict:
    warm = rows[1:] or rows
    med = {k: round(statistics.median(r[k] for r in warm), 4) for k in rows[0]}
    out = {"variant": name, "shape": shape, "gib": gib(nbytes), "switches": len(rows),
           "median_warm_s": med, "first_total_s": round(rows[0]["total"], 4), "all": rows}
    if shape in TARGET_S:
        out["target_s"] = TARGET_S[shape]
        out["target_met"] = med["total"] < TARGET_S[shape]
    out.update(extra or {})
    return out


def engine_for(shape: str, device: str, args) -> tuple[TorchEngine, int]:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build(shape, dtype, device)
    engine = TorchEngine(model, device=device, max_batch_size=args.gen_seqs)
    return engine, model.config.vocab_size


def run_file_before(args, shape: str, workdir: Path) -> dict:
    from safetensors.torch import load_file

    from tapioca.weights.files import save_weights, sha256_file

    dev = args.device
    trainer = build(shape, torch.float32, dev)
    engine, vocab = engine_for(shape, dev, args)
    dtype = next(engine.model.parameters()).dtype
    copies = timed_copies(engine)
    rows = []
    with Generating(engine, vocab, args.gen_seqs, args.gen_prompt, args.gen_new):
        for v in range(1, args.file_repeats + 1):
            perturb(trainer, v)
            sync(dev)
            t0 = time.monotonic()
            path = workdir / f"before-v{v}.safetensors"
            sha, size = save_weights(trainer.state_dict(), path, dtype=dtype)
            t1 = time.monotonic()
            if sha256_file(path) != sha:  # the reader before: one pass to hash, one to load
                raise RuntimeError("checksum mismatch")
            tensors = load_file(str(path))
            t3 = time.monotonic()
            engine.update_weights(tensors, v)
            sync(dev)
            t4 = time.monotonic()
            rows.append({"publish": t1 - t0, "handoff": 0.0, "fetch": t3 - t1, "update": t4 - t3,
                         "stall": copies[-1], "total": t4 - t0})
            path.unlink()
    engine.shutdown()
    del trainer, engine
    return summarise("file (before)", shape, size, rows)


def run_file(args, shape: str, workdir: Path) -> dict:
    from tapioca.schemas.envelope import decode_event, encode_event
    from tapioca.schemas.events import WeightsEvent
    from tapioca.weights import WeightPublisher, WeightReceiver

    dev = args.device
    trainer = build(shape, torch.float32, dev)
    engine, vocab = engine_for(shape, dev, args)
    pub = WeightPublisher("file", workdir / "file", device=dev,
                          publish_dtype=next(engine.model.parameters()).dtype, keep_versions=1)
    rec = WeightReceiver(dev)
    copies = timed_copies(engine)
    rows = []
    with Generating(engine, vocab, args.gen_seqs, args.gen_prompt, args.gen_new):
        for v in range(1, args.file_repeats + 2):
            perturb(trainer, v)
            sync(dev)
            t0 = time.monotonic()
            fields = pub.publish(trainer.state_dict(), v)
            payload = encode_event(WeightsEvent(version=v, **fields))
            t1 = time.monotonic()
            event = decode_event(payload)
            t2 = time.monotonic()
            tensors = rec.fetch(event)
            t3 = time.monotonic()
            engine.update_weights(tensors, v)
            sync(dev)
            t4 = time.monotonic()
            rows.append({"publish": t1 - t0, "handoff": t2 - t1, "fetch": t3 - t2,
                         "update": t4 - t3, "stall": copies[-1], "total": t4 - t0})
    nbytes = fields["num_bytes"]
    pub.close()
    engine.shutdown()
    del trainer, engine, tensors
    return summarise("file", shape, nbytes, rows)


def run_remote_trainer(args, shape: str, transport: str, workdir: Path, *, trainer_device: str,
                       engine_device: str, master_dtype: str, file_every: int, name: str) -> dict:
    """The trainer in a child process; this process is the engine (ipc, or nccl on GPUs)."""
    from tapioca.schemas.envelope import decode_event
    from tapioca.weights import WeightReceiver

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=trainer_proc, daemon=True, args=(there, {
        "shape": shape, "device": trainer_device, "master_dtype": master_dtype,
        "publish_dtype": "bfloat16" if engine_device.startswith("cuda") else "float32",
        "transport": transport, "dir": str(workdir / transport), "file_every": file_every,
        "bucket_bytes": args.bucket_bytes}))
    proc.start()
    engine = None
    try:
        engine, vocab = engine_for(shape, engine_device, args)  # while the trainer builds
        _recv(here)
        rec = WeightReceiver(engine_device, member="bench-engine")
        copies = timed_copies(engine)
        rows = []
        with Generating(engine, vocab, args.gen_seqs, args.gen_prompt, args.gen_new):
            for v in range(1, args.repeats + 2):
                here.send(("go", v))
                _, t0, t1, payload = _recv(here)
                event = decode_event(payload, max_bytes=64 << 20)
                t2 = time.monotonic()
                views = rec.fetch(event)
                t3 = time.monotonic()
                engine.update_weights(views, v)
                sync(engine_device)
                t4 = time.monotonic()
                rows.append({"publish": t1 - t0, "handoff": t2 - t1, "fetch": t3 - t2,
                             "update": t4 - t3, "stall": copies[-1], "total": t4 - t0})
        matches = engine_matches(engine, event, engine_device)
        here.send(("stop",))
        _, trainer_stats = _recv(here)
        rec.close()
        return summarise(name, shape, event.data_bytes, rows,
                         {"bitwise_equal": matches, "event_bytes": len(payload), **trainer_stats})
    finally:
        if engine is not None:
            engine.shutdown()
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def run_gloo(args, shape: str, workdir: Path) -> dict:
    """Trainer process + two receiver processes, all on CPU, the nccl transport over gloo."""
    ctx = mp.get_context("spawn")
    t_here, t_there = ctx.Pipe()
    trainer = ctx.Process(target=trainer_proc, daemon=True, args=(t_there, {
        "shape": shape, "device": "cpu", "master_dtype": "float32", "publish_dtype": "bfloat16",
        "transport": "nccl", "dir": str(workdir / "gloo"), "file_every": 0,
        "bucket_bytes": args.bucket_bytes, "threads": 4}))
    pipes, procs = [], []
    for m in range(2):
        here, there = ctx.Pipe()
        pipes.append(here)
        procs.append(ctx.Process(target=receiver_proc, args=(there, f"gloo-{m}"), daemon=True))
    trainer.start()
    for p in procs:
        p.start()
    try:
        _recv(t_here)
        for c in pipes:
            _recv(c)
        rows = []
        for v in range(1, args.gloo_repeats + 2):
            t_here.send(("go", v))
            _, t0, t1, payload = _recv(t_here)
            for c in pipes:
                c.send(("event", payload))
            done = [_recv(c) for c in pipes]
            t2 = min(d[1] for d in done)
            t3 = max(d[2] for d in done)
            t4 = max(d[3] for d in done)
            rows.append({"publish": t1 - t0, "handoff": t2 - t1, "fetch": t3 - t2,
                         "update": t4 - t3, "stall": t4 - t3, "total": t4 - t0})
        fast = []
        for c in pipes:
            c.send(("stop",))
            fast.append(_recv(c)[1])
        t_here.send(("stop",))
        _, stats = _recv(t_here)
        from tapioca.schemas.envelope import decode_event

        nbytes = decode_event(payload, max_bytes=64 << 20).data_bytes
        return summarise("nccl (gloo, CPU, 2 readers)", shape, nbytes, rows,
                         {"verified_fetches": fast, **stats})
    finally:
        for p in [trainer, *procs]:
            p.join(60)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------- main

def print_table(results: list[dict]) -> None:
    cols = ["variant", "shape", "GiB", "publish", "handoff", "fetch", "update", "(stall)",
            "total", "first", "bytes", "target"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], r["shape"], "-", *(["-"] * 8), "FAILED: " + r["error"][:60]])
            continue
        if "bitwise_equal" in r:
            check = "equal" if r["bitwise_equal"] else "MISMATCH"
        elif "verified_fetches" in r:
            check = "verified" if min(r["verified_fetches"]) == r["switches"] else "MISSING"
        else:
            check = "sha256"
        m = r["median_warm_s"]
        target = "-" if "target_s" not in r else (
            f"< {r['target_s']} s " + ("met" if r["target_met"] else "NOT met"))
        rows.append([r["variant"], r["shape"], f"{r['gib']:.2f}",
                     *(f"{m[k]:.4f}" for k in ("publish", "handoff", "fetch", "update", "stall",
                                              "total")),
                     f"{r['first_total_s']:.4f}", check, target])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print("seconds, median of the warm switches (first = the first switch, cold); the Kafka hop "
          "of the event is not included (+2-7 ms). bytes: equal = the engine's parameters have "
          "the trainer's checksums; verified = every receiver's checksums matched")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU self-check")
    ap.add_argument("--repeats", type=int, default=6, help="ipc / nccl switches (+1 cold)")
    ap.add_argument("--file-repeats", type=int, default=2)
    ap.add_argument("--gloo-repeats", type=int, default=3)
    ap.add_argument("--variants", default="file-before,file,ipc-small,ipc-big,gloo,nccl-gpu")
    ap.add_argument("--gloo-shape", default="", choices=["", *SHAPES],
                    help="shape of the gloo variant (default: the small shape)")
    ap.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    ap.add_argument("--gen-seqs", type=int, default=64)
    ap.add_argument("--gen-prompt", type=int, default=64)
    ap.add_argument("--gen-new", type=int, default=256)
    ap.add_argument("--dir", default="", help="where files go (default: a temp directory)")
    ap.add_argument("--out", default="", help="JSON path (default: $OUT/weight_switch.json)")
    args = ap.parse_args()
    small, big = ("tiny", "tiny-big") if args.tiny else ("0.5b", "7b")
    if args.tiny:
        args.gen_seqs, args.gen_prompt, args.gen_new = 8, 8, 32
        args.bucket_bytes = 64 << 10
    dev = args.device
    gpu = dev.startswith("cuda")
    todo = args.variants.split(",")
    results: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        work = Path(tmp)
        plan = [
            ("file-before", "file (before)", small, lambda: run_file_before(args, small, work)),
            ("file", "file", small, lambda: run_file(args, small, work)),
            ("ipc-small", "ipc", small, lambda: run_remote_trainer(
                args, small, "ipc", work, trainer_device=dev, engine_device=dev,
                master_dtype="float32", file_every=1, name="ipc (+ file every version)")),
            ("ipc-big", "ipc", big, lambda: run_remote_trainer(
                args, big, "ipc", work, trainer_device=dev, engine_device=dev,
                master_dtype="bfloat16" if gpu else "float32", file_every=0,
                name="ipc (bf16 trainer, no files)")),
            ("gloo", "nccl (gloo, CPU)", args.gloo_shape or small,
             lambda: run_gloo(args, args.gloo_shape or small, work)),
        ]
        if gpu and torch.cuda.device_count() >= 2:
            plan.append(("nccl-gpu", "nccl (2 GPUs)", small, lambda: run_remote_trainer(
                args, small, "nccl", work, trainer_device="cuda:0", engine_device="cuda:1",
                master_dtype="float32", file_every=0, name="nccl (cuda:0 -> cuda:1)")))
        for key, name, shape, fn in plan:
            if key not in todo:
                continue
            print(f"--- {name} {shape}", flush=True)
            t = time.monotonic()
            try:
                res = fn()
            except BaseException as exc:  # one failing variant must not lose the others
                traceback.print_exc()
                res = {"variant": name, "shape": shape, "error": f"{type(exc).__name__}: {exc}"}
            res["wall_s"] = round(time.monotonic() - t, 1)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "all"}), flush=True)
            gc.collect()  # the variant's models and buffers, before the next one's
            if gpu:
                torch.cuda.empty_cache()
    print()
    print_table(results)
    out = args.out or (os.path.join(os.environ["OUT"], "weight_switch.json")
                       if os.environ.get("OUT") else "")
    if out:
        info = {"torch": torch.__version__, "device": dev,
                "gpu": torch.cuda.get_device_name() if gpu else None}
        Path(out).write_text(json.dumps({"env": info, "results": results}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
