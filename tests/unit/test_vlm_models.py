"""Vision-language models end to end in one process (models/vision.py, the engines, the
trainer): tiny random Qwen2.5-VL and Qwen3-VL from their real transformers classes.

The reference everywhere is one no-cache forward of prompt + output through the HF
model's own modules: its vision tower's embeddings written over the placeholder tokens
(those the model did not generate), 3-D rotary positions, and Qwen3-VL's deepstack
through the HF text model's own ``visual_pos_masks`` / ``deepstack_visual_embeds``.
The random models sample ``<|image_pad|>`` tokens now and then; those are ordinary
tokens for engine, trainer and reference alike (the rule of models/vision.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from test_image_admission import bomb_png, spy_decodes

from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import ActorConfig
from tapioca.engines.base import GenRequest, RequestImages, SamplingParams
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.torch_engine import TorchEngine
from tapioca.media.images import ImageError
from tapioca.media.store import FileImageStore, sha256_hex
from tapioca.models.factory import load_model_and_tokenizer, save_tiny_checkpoint
from tapioca.models.vision import (
    ImageLoader,
    ImageProcessor,
    VisionPrompts,
    expand_image_tokens,
    image_features,
    image_runs,
    mrope_positions,
    placeholder_mask,
)
from tapioca.schemas.errors import BadEventError, EngineError
from tapioca.schemas.events import ImageRef, SampleEvent, SampleSequence
from tapioca.tasks.visual import VISUAL_ALPHABET, draw
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.ppo_actor import PPOActor

ARCHS = ("qwen2_5_vl", "qwen3_vl")
ATOL = 1e-5


def _png(width: int, height: int, colour) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


class VL:
    """A tiny VL checkpoint, its tokenizer, an image store and prompts with images."""

    def __init__(self, arch: str, root) -> None:
        self.dir = save_tiny_checkpoint(root / arch, arch=arch, alphabet=VISUAL_ALPHABET)
        self.model, self.tokenizer = load_model_and_tokenizer(self.dir)
        self.store = FileImageStore(root / f"{arch}-images")
        self.vp = VisionPrompts(self.dir, self.tokenizer, self.store, max_pixels=10**8, inline_max_bytes=256)
        self.loader = ImageLoader(self.store, ImageProcessor.from_dir(self.dir))
        self.spec = self.vp.spec

    def prompt(self, k: int, two_images: bool = False):
        blobs = [draw("color", k)[0]] + ([_png(90 + 10 * k, 130, (3 * k, 4, 5))] if two_images else [])
        content = [{"type": "image"}, {"type": "text", "text": "color?" * (k + 1)}]
        content += [{"type": "image"}] if two_images else []
        return self.vp.encode({"messages": [{"role": "user", "content": content}], "images": blobs})

    def request(self, rid: str, ids, refs, max_new: int = 6, temperature: float = 1.0) -> GenRequest:
        pv, grids = self.loader.pixels(refs)
        return GenRequest(rid, ids, SamplingParams(temperature=temperature, max_new_tokens=max_new),
                          RequestImages([r.sha256 for r in refs], grids, pv) if refs else None)

    def reference_logprobs(self, ids: list[int], n_out: int, refs, generated=None) -> torch.Tensor:
        m = self.model
        full = torch.tensor([ids])
        gen = [0] * (len(ids) - n_out) + [1] * n_out if generated is None else generated
        with torch.no_grad():
            if refs:
                pv, grids = self.loader.pixels(refs)
                mask = placeholder_mask(ids, self.spec, gen)
                pos, _ = mrope_positions(ids, mask, grids, self.spec)
                emb = m.get_input_embeddings()(full)
                feats, deep = image_features(m, pv, torch.tensor(grids))
                emb[0, torch.from_numpy(mask)] = feats
                extra = {"visual_pos_masks": torch.from_numpy(mask)[None], "deepstack_visual_embeds": deep} \
                    if deep else {}
                h = m.model.language_model(inputs_embeds=emb, position_ids=torch.from_numpy(pos)[:, None],
                                           use_cache=False, **extra).last_hidden_state
                logits = m.lm_head(h)
            else:
                logits = m(input_ids=full, use_cache=False).logits
        lp = torch.log_softmax(logits[0, len(ids) - n_out - 1:-1].float(), -1)
        return lp.gather(-1, torch.tensor(ids[len(ids) - n_out:])[:, None])[:, 0]


@pytest.fixture(scope="module", params=ARCHS)
def vl(request, tmp_path_factory):
    torch.manual_seed(0)
    return VL(request.param, tmp_path_factory.mktemp("vl"))


def test_positions_equal_transformers_rope_index(vl):
    ids, _, refs = vl.prompt(1, two_images=True)
    mask = placeholder_mask(ids, vl.spec)
    _, grids = vl.loader.pixels(refs)
    pos, delta = mrope_positions(ids, mask, grids, vl.spec)
    hf_pos, hf_delta = vl.model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.from_numpy(mask.astype(np.int64))[None],
        image_grid_thw=torch.tensor(grids))
    assert torch.equal(hf_pos[:, 0], torch.from_numpy(pos)) and delta == int(hf_delta)


def test_placeholders_are_expanded_per_image_and_checked(vl):
    ids, _, refs = vl.prompt(0, two_images=True)
    grids = [vl.vp.processor.grid_for(r.width, r.height) for r in refs]
    assert grids == vl.loader.pixels(refs)[1]  # the grid from the size alone = the processor's
    need = [vl.spec.tokens_for(g) for g in grids]
    assert int((np.asarray(ids) == vl.spec.image_token_id).sum()) == sum(need)
    one = [vl.spec.image_token_id]
    with pytest.raises(ImageError, match="1 image placeholder"):
        expand_image_tokens(one, grids, vl.spec)
    with pytest.raises(ImageError, match="need"):
        image_runs(placeholder_mask(ids[:-3] + one * 3, vl.spec), grids[:1], vl.spec)


def test_processor_output_is_recomputed_identically_from_the_bytes(vl):
    _, _, refs = vl.prompt(2, two_images=True)
    blobs = vl.loader.blobs(refs)
    pv1, g1 = ImageProcessor.from_dir(vl.dir)(blobs)
    pv2, g2 = ImageProcessor.from_dir(vl.dir)(blobs)
    assert torch.equal(pv1, pv2) and torch.equal(g1, g2)


@pytest.mark.parametrize("engine", ["torch", "paged"])
def test_engine_logprobs_match_the_reference_forward(vl, engine):
    reqs = []
    for k in range(4):
        ids, _, refs = vl.prompt(k, two_images=k % 2 == 0)
        reqs += [(vl.request(f"r{k}-{j}", ids, refs), refs) for j in range(2)]  # groups of 2
    text = vl.tokenizer("color?", add_special_tokens=False)["input_ids"]
    reqs.append((vl.request("text", text, []), []))
    eng = TorchEngine(vl.model, seed=1, max_batch_size=16) if engine == "torch" else \
        PagedEngine(vl.model, seed=1, max_batch_size=16, kv_cache_tokens=4096, kv_block_size_tokens=4)
    try:
        results = eng.generate([q for q, _ in reqs])
    finally:
        eng.shutdown()
    for (q, refs), r in zip(reqs, results):
        ref = vl.reference_logprobs(q.prompt_ids + r.output_ids, len(r.output_ids), refs)
        assert torch.allclose(ref, torch.tensor(r.output_logprobs), atol=ATOL), r.request_id


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU box: gpu_call.sh vlm_tests)")
def test_paged_engine_on_cuda_with_graphs(vl):
    """The VL prefill and the graph-replayed decode (rope positions + delta) on a GPU."""
    import copy

    reqs = []
    for k in range(3):
        ids, _, refs = vl.prompt(k, two_images=k == 0)
        reqs += [(vl.request(f"r{k}-{j}", ids, refs), refs) for j in range(2)]
    model = copy.deepcopy(vl.model).cuda()
    eng = PagedEngine(model, device="cuda", seed=1, max_batch_size=8, kv_cache_tokens=4096, cuda_graphs=True)
    try:
        results = eng.generate([q for q, _ in reqs])
        assert eng.stats()["cuda_graphs"] >= 1
    finally:
        eng.shutdown()
    for (q, refs), r in zip(reqs, results):  # the CPU fp32 reference of the same weights
        ref = vl.reference_logprobs(q.prompt_ids + r.output_ids, len(r.output_ids), refs)
        assert torch.allclose(ref, torch.tensor(r.output_logprobs), atol=1e-3), r.request_id


def test_paged_prefix_cache_is_keyed_by_the_images(vl):
    ids, _, refs = vl.prompt(0)
    # The same image, a shorter text: its one cached block ends inside the image's 4
    # placeholders (blocks of 4: <bos> <|vision_start|> pad pad | pad pad <|vision_end|> c).
    short, _, _ = vl.vp.encode({"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "c"}]}], "images": [draw("color", 0)[0]]})
    other = vl.vp.refs([_png(56, 56, (0, 0, 250))])
    eng = PagedEngine(vl.model, seed=1, max_batch_size=8, kv_cache_tokens=4096, kv_block_size_tokens=4)
    try:
        first = eng.generate([vl.request("a", ids, refs, temperature=0.0)])[0]
        hits = eng.stats()["prefix_cache_hit_blocks"]
        again = eng.generate([vl.request("b", ids, refs, temperature=0.0)])[0]
        assert eng.stats()["prefix_cache_hit_blocks"] > hits  # same tokens, same image: reused
        hits = eng.stats()["prefix_cache_hit_blocks"]
        swapped = eng.generate([vl.request("c", ids, other, temperature=0.0)])[0]
        assert eng.stats()["prefix_cache_hit_blocks"] == hits  # same tokens, another image: not
        split = eng.generate([vl.request("d", short, refs, temperature=0.0)])[0]
        assert eng.stats()["prefix_cache_hit_blocks"] == hits + 1  # half the image from the cache
    finally:
        eng.shutdown()
    assert again.output_ids == first.output_ids
    for r, rr, p in ((first, refs, ids), (again, refs, ids), (swapped, other, ids), (split, refs, short)):
        ref = vl.reference_logprobs(p + r.output_ids, len(r.output_ids), rr)
        assert torch.allclose(ref, torch.tensor(r.output_logprobs), atol=ATOL)


@pytest.mark.parametrize("engine", ["torch", "paged"])
def test_weight_updates_carry_the_vision_tower(vl, engine):
    ids, _, refs = vl.prompt(1)
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.2 * torch.randn(v.shape, generator=g) if ".visual." in f".{k}" else v.clone()
           for k, v in vl.model.state_dict().items()}
    assert any("visual" in k for k in new)
    model = load_model_and_tokenizer(vl.dir)[0]
    eng = TorchEngine(model, seed=1) if engine == "torch" else \
        PagedEngine(model, seed=1, kv_cache_tokens=2048, kv_block_size_tokens=4)
    try:
        before = eng.generate([vl.request("a", ids, refs, temperature=0.0, max_new=4)])[0]
        eng.update_weights(new, 1)
        after = eng.generate([vl.request("b", ids, refs, temperature=0.0, max_new=4)])[0]
    finally:
        eng.shutdown()
    assert not np.allclose(before.output_logprobs, after.output_logprobs)
    original = {k: v.clone() for k, v in vl.model.state_dict().items()}
    vl.model.load_state_dict(new)
    try:  # the reference with the new vision tower
        ref = vl.reference_logprobs(ids + after.output_ids, len(after.output_ids), refs)
    finally:
        vl.model.load_state_dict(original)
    assert torch.allclose(ref, torch.tensor(after.output_logprobs), atol=ATOL)
    assert after.output_versions == [1] * len(after.output_ids)


def test_engines_refuse_images_they_cannot_use(vl, tmp_path):
    ids, _, refs = vl.prompt(0)
    eng = PagedEngine(vl.model, seed=1, kv_cache_tokens=1024)
    try:
        with pytest.raises(EngineError, match="placeholder"):
            eng.submit(vl.request("no-images", ids, []))  # placeholders, no images
        with pytest.raises(EngineError, match="placeholder"):
            eng.submit(vl.request("short", ids[:3] + ids[5:], refs))  # two placeholders missing
    finally:
        eng.shutdown()
    text_dir = save_tiny_checkpoint(tmp_path / "text", alphabet=VISUAL_ALPHABET)
    text_model = load_model_and_tokenizer(text_dir)[0]
    eng = TorchEngine(text_model)
    try:
        pv, grids = vl.loader.pixels(refs)
        with pytest.raises(EngineError, match="no vision tower"):
            eng.submit(GenRequest("x", [1, 2], SamplingParams(), RequestImages([refs[0].sha256], grids, pv)))
    finally:
        eng.shutdown()


def _items(vl, seed: int = 3):
    reqs = []
    for k in range(3):
        ids, _, refs = vl.prompt(k, two_images=k == 0)
        reqs.append((vl.request(f"r{k}", ids, refs), refs))
    eng = TorchEngine(vl.model, seed=seed)
    try:
        results = eng.generate([q for q, _ in reqs])
    finally:
        eng.shutdown()
    items = [SeqItem(group_id=f"g{i}", input_ids=q.prompt_ids + r.output_ids, prompt_len=len(q.prompt_ids),
                     behav_logprobs=r.output_logprobs, versions=[0] * len(r.output_ids),
                     loss_mask=[1] * len(r.output_ids), advantage=1.0 if i % 2 else -1.0, reward=0.0,
                     images=refs) for i, ((q, refs), r) in enumerate(zip(reqs, results))]
    return items, results


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_trainer_logprobs_equal_the_engines(vl, packed):
    items, results = _items(vl)
    actor = PPOActor(vl.model, ActorConfig(packed_sequences=packed), temperature=1.0, pad_token_id=0,
                     images=vl.loader)
    (mb,) = actor.micro_batches(items)
    with torch.no_grad():
        lp_BT, _ = actor.logprobs(mb)
    for b, gid in enumerate(mb.group_ids):
        it, r = items[int(gid[1:])], results[int(gid[1:])]
        got = lp_BT[b, it.prompt_len - 1:it.length - 1]
        assert torch.allclose(got, torch.tensor(r.output_logprobs), atol=ATOL)


@pytest.mark.parametrize("freeze", [False, True])
def test_freeze_vision_encoder(vl, freeze):
    model = load_model_and_tokenizer(vl.dir)[0]
    items, _ = _items(vl)
    actor = PPOActor(model, ActorConfig(optimizer=OptimizerConfig(lr=1e-2)), temperature=1.0, pad_token_id=0,
                     images=vl.loader, freeze_vision_encoder=freeze)
    tower = {k: v.clone() for k, v in model.model.visual.state_dict().items()}
    text = {k: v.clone() for k, v in model.model.language_model.state_dict().items()}
    result = actor.train_step(items, policy_version=0)
    assert result.applied_minibatches == 1
    tower_moved = any(not torch.equal(tower[k], v) for k, v in model.model.visual.state_dict().items())
    assert tower_moved is not freeze
    assert any(not torch.equal(text[k], v) for k, v in model.model.language_model.state_dict().items())
    optimised = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert all((id(p) in optimised) is not freeze for p in model.model.visual.parameters())


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_trainer_dead_letters_samples_whose_images_it_cannot_use(vl, tmp_path, monkeypatch):
    decodes = spy_decodes(monkeypatch)
    items, results = _items(vl)
    it, r = items[1], results[1]

    def sample(images, prompt_ids=None):
        return SampleEvent(group_id="g", prompt_id="p", prompt_ids=prompt_ids or it.input_ids[:it.prompt_len],
                           sequences=[SampleSequence(traj_id="g:0", output_ids=r.output_ids,
                                                     behav_logprobs=r.output_logprobs,
                                                     output_versions=[0] * len(r.output_ids), reward=1.0,
                                                     advantage=0.5, images=images)])

    actor = PPOActor(vl.model, ActorConfig(), temperature=1.0, pad_token_id=0, images=vl.loader)
    actor.check_images(sample(it.images))  # usable
    empty = ImageLoader(FileImageStore(tmp_path / "empty"), vl.loader.processor)
    big = vl.vp.refs([_png(300, 300, (9, 9, 9))])[0]
    big.data_b64 = ""
    missing = PPOActor(vl.model, ActorConfig(), temperature=1.0, pad_token_id=0, images=empty)
    with pytest.raises(BadEventError, match="not in the image store"):
        missing.check_images(sample([big]))
    with pytest.raises(BadEventError, match="placeholder"):
        actor.check_images(sample(it.images + it.images))  # two images, one placeholder run
    # An image bomb inline on the sample (a ~20 KB PNG of 13000 x 13000): refused from its
    # header, nothing of it decoded; the next good sample is still usable.
    bomb = bomb_png()
    bomb_ref = ImageRef(sha256=sha256_hex(bomb), width=13000, height=13000,
                        data_b64=base64.b64encode(bomb).decode())
    with pytest.raises(BadEventError, match="group g: the image is 13000 x 13000 = 169,000,000 pixels, over"):
        actor.check_images(sample([bomb_ref]))
    assert (13000, 13000) not in decodes
    actor.check_images(sample(it.images))
    text_dir = save_tiny_checkpoint(tmp_path / "text", alphabet=VISUAL_ALPHABET)
    text_actor = PPOActor(load_model_and_tokenizer(text_dir)[0], ActorConfig(), temperature=1.0, pad_token_id=0)
    with pytest.raises(BadEventError, match="no vision tower"):
        text_actor.check_images(sample(it.images))
