"""Vision-language rollout and training, issue 24: Tapioca's engines and trainer vs HF
``generate`` and the plain HF forward + backward, side by side in one process.

Consumes nothing (random weights from ``Qwen2_5_VLConfig``, images drawn with PIL); emits
a table on stdout and JSON (``--out``, or ``$OUT/vlm.json`` when ``$OUT`` is set).

Model: Qwen2.5-VL-3B's published shape (text 36 layers x 2048, 16 / 2 heads, vocab
151,936, tied embeddings, M-RoPE sections 16/24/24; vision tower 32 blocks x 1280, 16
heads, window attention with full attention at blocks 7/15/23/31, merger to 2048),
random weights in bf16, sdpa attention. Workload: ``--prompts`` (64) prompts, each one
``--image-size`` (448) x 448 PNG image (1,024 patches of 14 px, 256 placeholder tokens
after the 2 x 2 merge) and ~24 text tokens, ``--samples`` (8) samples each,
``--new-tokens`` (256) new tokens (no eos: every sequence runs to its length),
temperature 1. Images go through the slow PIL/numpy processor (its CPU time is
reported: ``processor_s``).

Generation systems (``--systems``): ``paged`` (PagedEngine: vision tower once per prompt
at prefill, the group's prompt prefilled once, CUDA-graph decode), ``torch``
(TorchEngine: the HF forward with its vision tower, KV slots of our own), ``hf`` (one
``model.generate(pixel_values=..., num_return_sequences=samples, do_sample=True)``,
left-padded). Our engines get one warm-up call of the whole workload (CUDA-graph
captures; no prefix cache, so the timed call prefills everything again), HF one on 2
prompts; then one timed call each;
tokens/s = new tokens / wall seconds; peak memory = ``torch.cuda.max_memory_allocated``.

Training (``--train``): ``--train-seqs`` (64) of the generated sequences (8 groups x 8
samples: 280 prompt + 256 output tokens each, the image's pixels recomputed from its
bytes), one warm-up step then ``--train-steps`` timed steps (median), a fresh model each:
``ours`` = PPOActor, packed VL forward (flash varlen, liger kernels when installed,
Triton logprobs, bf16 weights + fp32 masters, fused AdamW, recompute SwiGLU; micro-batches
of 4,096 tokens = 7 sequences and their images); ``hf`` =
the plain HF step of benchmarks/trainer_systems.py with images (fp32 weights, bf16
autocast, ``model(input_ids, pixel_values, image_grid_thw)``'s full logits, fp32
log-softmax, fused AdamW) in micro-batches of ``--hf-mb-rows`` rows. tokens/s counts
every token of the step (prompt + output), peak memory as above.

GPU (one H200; ~3-4 min):

    python benchmarks/vlm.py --device cuda

CPU plumbing check (a tiny random Qwen2.5-VL, < 2 min): ``python benchmarks/vlm.py --smoke``.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import env_info, peak_gib, print_table, timed, write_json  # noqa: E402
from engine_generate import reset_peak as reset_memory  # noqa: E402

from tapioca.config.optimizer import OptimizerConfig  # noqa: E402
from tapioca.config.schema import ActorConfig  # noqa: E402
from tapioca.engines.base import GenRequest, RequestImages, SamplingParams  # noqa: E402
from tapioca.media.images import store_image  # noqa: E402
from tapioca.media.store import FileImageStore  # noqa: E402
from tapioca.models.vision import ImageLoader, ImageProcessor  # noqa: E402
from tapioca.trainers.batching import SeqItem  # noqa: E402

# Qwen2.5-VL's special tokens (its tokenizer's ids) and processor.
IM_START, IM_END, NL, USER, ASSISTANT = 151644, 151645, 198, 872, 77091
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
PROCESSOR = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                 max_pixels=28 * 28 * 1280, image_mean=[0.48145466, 0.4578275, 0.40821073],
                 image_std=[0.26862954, 0.26130258, 0.27577711])
QWEN25_VL_3B = dict(
    text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
              num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
              rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    mrope_section=[16, 24, 24])
TINY = dict(
    text=dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
              rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6),
    vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[0], hidden_act="silu"),
    mrope_section=[4, 6, 6])
FAST = dict(packed_sequences=True, param_dtype="bfloat16", autocast_dtype="", attention_backend="auto",
            logprob_kernel="auto", fused_optimizer=True, logprob_chunk_tokens=8192,
            logprob_keep_logits=True, recompute_swiglu=True, mb_max_tokens=4096)


def vl_config(shape: dict):
    """The Qwen2.5-VL config of ``shape`` (its config.json is what `tapioca plan` reads)."""
    from transformers import Qwen2_5_VLConfig

    rope = {"type": "mrope", "rope_type": "default", "mrope_section": shape["mrope_section"],
            "rope_theta": shape["text"]["rope_theta"]}
    text = {k: v for k, v in shape["text"].items() if k != "rope_theta"}
    cfg = Qwen2_5_VLConfig(text_config={**text, "rope_scaling": rope, "rope_parameters": rope},
                           vision_config=shape["vision"], image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
                           vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                           tie_word_embeddings=text["tie_word_embeddings"])
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def build_model(shape: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    cfg = vl_config(shape)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def draw_image(i: int, size: int) -> bytes:
    """A PNG of a few random shapes (what a geometry or counting prompt shows)."""
    from PIL import Image, ImageDraw

    rng = random.Random(i)
    im = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    d = ImageDraw.Draw(im)
    for _ in range(8):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        x1, y1 = min(size - 1, x0 + rng.randrange(8, size // 2)), min(size - 1, y0 + rng.randrange(8, size // 2))
        d.rectangle([x0, y0, x1, y1], fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


class Workload:
    """The prompts: ids with the expanded placeholders, each image's ref and tensors."""

    def __init__(self, n_prompts: int, image_size: int, text_tokens: int, store_dir: str) -> None:
        self.store = FileImageStore(store_dir)
        self.processor = ImageProcessor(**PROCESSOR)
        self.loader = ImageLoader(self.store, self.processor, cache_images=n_prompts + 8)
        t0 = time.perf_counter()
        self.refs = [store_image(draw_image(i, image_size), self.store) for i in range(n_prompts)]
        self.pixels = [self.loader.pixels([r]) for r in self.refs]
        self.processor_s = time.perf_counter() - t0
        rng = random.Random(1)
        self.prompts = []
        for pv, grids in self.pixels:
            n_img = grids[0][0] * grids[0][1] * grids[0][2] // 4
            text = [rng.randrange(10000) for _ in range(text_tokens)]
            self.prompts.append([IM_START, USER, NL, VISION_START] + [IMAGE_PAD] * n_img + [VISION_END]
                                + text + [IM_END, NL, IM_START, ASSISTANT, NL])

    def requests(self, n_prompts: int, samples: int, new_tokens: int, with_pixels: bool = True) -> list[GenRequest]:
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
        out = []
        for k in range(n_prompts):
            (pv, grids), ref = self.pixels[k], self.refs[k]
            images = RequestImages([ref.sha256], grids, pv)
            out += [GenRequest(f"p{k}:{j}", self.prompts[k], sp, images) for j in range(samples)]
        return out


# ---------------------------------------------------------------------- generation


def gen_ours(system: str, model, w: Workload, args) -> tuple[dict, list]:
    from tapioca.engines.paged_engine import PagedEngine
    from tapioca.engines.torch_engine import TorchEngine

    rows = args.prompts * args.samples
    longest = max(len(p) for p in w.prompts) + args.new_tokens
    if system == "paged":
        eng = PagedEngine(model, device=args.device, max_batch_size=rows, max_prefill_tokens=32768,
                          kv_cache_tokens=rows * longest + 64 * 16, cuda_graphs=args.device.startswith("cuda"),
                          prefix_caching=False, seed=0)
    else:
        eng = TorchEngine(model, device=args.device, max_batch_size=rows, seed=0)
    try:
        requests = w.requests(args.prompts, args.samples, args.new_tokens)
        eng.generate(requests)  # warm-up: every graph width the timed call needs
        reset_memory(args.device)
        before = eng.stats() if system == "paged" else {}

        def run() -> int:
            futures = []
            for k in range(args.prompts):  # a group at a time, as the rollout worker submits
                futures += eng.submit_all(requests[k * args.samples:(k + 1) * args.samples])
            results[:] = [f.result() for f in futures]
            return sum(len(r.output_ids) for r in results)

        results: list = []
        n, wall = timed(run, args.device)
        assert all(len(r.output_ids) == args.new_tokens for r in results), "a sequence stopped early"
        out = {"tokens": n, "wall_s": round(wall, 3), "tokens_per_s": round(n / wall, 1),
               "peak_mem_gib": peak_gib(args.device)}
        if system == "paged":
            st = eng.stats()
            out.update(decode_step_ms=st["decode_only_step_ms"],  # warm-up and timed calls
                       prefill_tokens_computed=st["prefill_tokens_computed"] - before["prefill_tokens_computed"],
                       prefill_tokens_requested=st["prefill_tokens_requested"] - before["prefill_tokens_requested"])
        return out, results
    finally:
        eng.shutdown()


def gen_hf(model, w: Workload, args) -> dict:
    def call(n_prompts: int, new_tokens: int) -> int:
        prompts = w.prompts[:n_prompts]
        L = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        pv = torch.cat([w.pixels[k][0] for k in range(n_prompts)]).to(args.device, model.dtype)
        grid = torch.tensor([w.pixels[k][1][0] for k in range(n_prompts)], device=args.device)
        mm = (ids == IMAGE_PAD).int().to(args.device)
        out = model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                             pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm,
                             do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             num_return_sequences=args.samples, pad_token_id=0)
        return (out.shape[1] - L) * out.shape[0]

    with torch.inference_mode():
        call(min(2, args.prompts), min(8, args.new_tokens))
        reset_memory(args.device)
        n, wall = timed(lambda: call(args.prompts, args.new_tokens), args.device)
    return {"tokens": n, "wall_s": round(wall, 3), "tokens_per_s": round(n / wall, 1),
            "peak_mem_gib": peak_gib(args.device)}


# ---------------------------------------------------------------------- training


def train_items(w: Workload, results: list, n: int) -> list[SeqItem]:
    items = []
    for r in results[:n]:
        k = int(r.request_id[1:].split(":")[0])
        adv = 1.0 if int(r.request_id.split(":")[1]) % 2 else -1.0
        items.append(SeqItem(group_id=f"g{k}", input_ids=list(r.prompt_ids) + list(r.output_ids),
                             prompt_len=len(r.prompt_ids), behav_logprobs=list(r.output_logprobs),
                             versions=[0] * len(r.output_ids), loss_mask=[1] * len(r.output_ids),
                             advantage=adv, reward=adv, images=[w.refs[k]]))
    return items


def train_ours(shape, w: Workload, items: list[SeqItem], args) -> dict:
    import importlib.util

    from tapioca.trainers.ppo_actor import PPOActor

    model = build_model(shape, torch.bfloat16, args.device)
    cuda = args.device.startswith("cuda")
    opts = dict(FAST, liger_kernels=cuda and importlib.util.find_spec("liger_kernel") is not None)
    if not cuda:
        opts.update(param_dtype="float32", fused_optimizer=False, logprob_keep_logits=False, recompute_swiglu=False)
    if args.train_ac:  # activation checkpointing of every decoder layer: fits an 80 GB card
        opts.update(gradient_checkpointing=True, recompute_swiglu=False)
    cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-6), device=args.device, **opts)
    actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=args.device, images=w.loader,
                     freeze_vision_encoder=args.freeze_vision)

    def step() -> int:
        actor.train_step(items, policy_version=0)
        return sum(it.length for it in items)

    return train_timed(step, args, describe=actor.packed.describe())


def train_hf(shape, w: Workload, items: list[SeqItem], args) -> dict:
    from tapioca.models.forward import autocast_context

    cuda = args.device.startswith("cuda")
    model = build_model(shape, torch.float32, args.device)
    if args.train_ac:
        model.gradient_checkpointing_enable()
    if args.freeze_vision:
        from tapioca.models.vision import vision_tower

        for p in vision_tower(model).parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6,
                            fused=True if cuda else None)
    mbs = [items[i:i + args.hf_mb_rows] for i in range(0, len(items), args.hf_mb_rows)]
    total_out = sum(it.length - it.prompt_len for it in items)

    def tensors(mb):
        L = max(it.length for it in mb)
        ids = torch.zeros(len(mb), L, dtype=torch.long)
        attn = torch.zeros_like(ids)
        lossm = torch.zeros(len(mb), L - 1)
        for b, it in enumerate(mb):  # right padding
            ids[b, :it.length] = torch.tensor(it.input_ids)
            attn[b, :it.length] = 1
            lossm[b, it.prompt_len - 1:it.length - 1] = it.advantage
        pv, grids = w.loader.pixels([r for it in mb for r in it.images])
        return (ids.to(args.device), attn.to(args.device), lossm.to(args.device), pv.to(args.device),
                torch.tensor(grids, device=args.device))

    batches = [tensors(mb) for mb in mbs]

    def step() -> int:
        model.train()
        for ids, attn, lossm, pv, grid in batches:
            mm = (ids == IMAGE_PAD).int()
            with autocast_context(args.device, "bfloat16" if cuda else ""):
                logits = model(input_ids=ids, attention_mask=attn, pixel_values=pv, image_grid_thw=grid,
                               mm_token_type_ids=mm, use_cache=False).logits
            logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(logp * lossm).sum() / total_out).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(it.length for it in items)

    return train_timed(step, args, describe=f"plain HF, micro-batches of {args.hf_mb_rows} rows")


def train_timed(step, args, *, describe: str) -> dict:
    step()  # warm-up (kernel autotune, allocator)
    reset_memory(args.device)
    walls = []
    for _ in range(args.train_steps):
        n, wall = timed(step, args.device)
        walls.append(wall)
    wall = statistics.median(walls)
    return {"tokens": n, "step_s": round(wall, 3), "tokens_per_s": round(n / wall, 1),
            "peak_mem_gib": peak_gib(args.device), "path": describe}


# ---------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload on CPU (plumbing)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--text-tokens", type=int, default=16)
    ap.add_argument("--systems", default="paged,hf", help="generation: paged, torch, hf")
    ap.add_argument("--train", default="ours,hf", help="training: ours, hf (empty: none)")
    ap.add_argument("--train-seqs", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--hf-mb-rows", type=int, default=8)
    # Issue 37: the training rows on an 80 GB card (both systems alike)
    ap.add_argument("--train-ac", action="store_true", help="activation checkpointing of the decoder layers")
    ap.add_argument("--freeze-vision", action="store_true", help="vlm.freeze_vision_encoder: no grads for the tower")
    ap.add_argument("--out", default="")
    ap.add_argument("--write-config", metavar="DIR", help="only write the shape's config.json to DIR (for "
                    "`tapioca plan --config examples/vlm/geometry3k.yaml model.path=DIR`; no weights)")
    args = ap.parse_args()
    shape = QWEN25_VL_3B
    if args.write_config:
        vl_config(TINY if args.smoke else shape).save_pretrained(args.write_config)
        print(f"{args.write_config}/config.json")
        return
    if args.smoke:
        shape = TINY
        args.device = "cpu"
        args.prompts, args.samples, args.new_tokens, args.image_size = 4, 2, 8, 56
        args.train_seqs, args.train_steps, args.hf_mb_rows = 8, 1, 4
        args.systems = "paged,torch,hf"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(env_info(args.device))
    report: dict = {"env": env_info(args.device), "args": vars(args), "generation": {}, "training": {}}
    with tempfile.TemporaryDirectory() as tmp:
        w = Workload(args.prompts, args.image_size, args.text_tokens, tmp)
        report["processor_s"] = round(w.processor_s, 3)
        report["prompt_tokens"] = len(w.prompts[0])
        print(f"{args.prompts} images of {args.image_size}^2 processed in {w.processor_s:.2f} s (CPU, slow "
              f"processor); prompt {len(w.prompts[0])} tokens")
        model = build_model(shape, torch.bfloat16 if args.device.startswith("cuda") else torch.float32, args.device)
        results = None
        for system in [s for s in args.systems.split(",") if s]:
            reset_memory(args.device)
            try:
                if system == "hf":
                    report["generation"][system] = gen_hf(model, w, args)
                else:
                    report["generation"][system], res = gen_ours(system, model, w, args)
                    results = results or res
            except Exception as exc:  # a failing system records its error; the rest still run
                report["generation"][system] = {"error": f"{type(exc).__name__}: {exc}"}
            print(system, report["generation"][system], flush=True)
        del model
        if results is None:  # training needs sequences: the paged engine's (or a quick one)
            _, results = gen_ours("paged", build_model(shape, torch.float32, "cpu"), w, args) \
                if args.device == "cpu" else (None, [])
        items = train_items(w, results, args.train_seqs)
        for system in [s for s in args.train.split(",") if s and items]:
            reset_memory(args.device)
            try:
                fn = train_ours if system == "ours" else train_hf
                report["training"][system] = fn(shape, w, items, args)
            except Exception as exc:
                report["training"][system] = {"error": f"{type(exc).__name__}: {exc}"}
            print(system, report["training"][system], flush=True)
    g, t = report["generation"], report["training"]
    print("\ngeneration (new tokens / s, peak GiB)")
    print_table(["system", "tokens/s", "wall s", "peak GiB"],
                [[k, v.get("tokens_per_s"), v.get("wall_s"), v.get("peak_mem_gib")] for k, v in g.items()])
    print("\ntraining (all tokens / s, peak GiB)")
    print_table(["system", "tokens/s", "step s", "peak GiB"],
                [[k, v.get("tokens_per_s"), v.get("step_s"), v.get("peak_mem_gib")] for k, v in t.items()])
    out = args.out or (str(Path(__import__("os").environ["OUT"]) / "vlm.json")
                       if __import__("os").environ.get("OUT") else "")
    write_json(out, report)


if __name__ == "__main__":
    main()
