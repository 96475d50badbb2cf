"""Routing replay (issue 23, items 3 and 5) on CPU: the wire encoding of routed experts and
the blob store, the paged engine's recorded routes (every fed token, groups, prefix-cache
hits, graph-bucket padding; CUDA graphs on a GPU), the rollout worker and the advantage
processor carrying them, the trainer replaying them (R3) or its own first pass (R2), the
rollout-train metrics, and what the trainer does with bad or missing routes. No broker
(the real loop is tests/e2e/test_router_replay_loop.py).
"""

from __future__ import annotations

import base64
import math
import time

import numpy as np
import orjson
import pytest
import torch
from test_moe_training import VOCAB, actor, items, moe_model  # the same tiny Qwen3-MoE

from tapioca.bus.role import Source
from tapioca.config.moe import MoeConfig
from tapioca.config.schema import ActorConfig, GenerationConfig, ModelConfig, RolloutConfig
from tapioca.config.sections import AdvantageSection, RolloutSection, TrainerSection
from tapioca.consumers.advantage import AdvantageProcessor
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.paged_engine import PagedEngine
from tapioca.media.store import FileBlobStore, MissingBlobError
from tapioca.models.attention import packed_seqs, position_ids
from tapioca.models.packed import PackedCausalLM
from tapioca.producers.rollout import RolloutWorker
from tapioca.runtime.builders import in_process_engine
from tapioca.schemas.envelope import decode_event, encode_event
from tapioca.schemas.errors import BadEventError, ConfigError, SchemaError
from tapioca.schemas.events import (
    PromptEvent,
    RewardEvent,
    RoutedExperts,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
)
from tapioca.schemas.routes import decode_routes, encode_routes
from tapioca.trainers.batching import SeqItem, flatten_groups
from tapioca.trainers.packing import to_packed
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.trainer import Trainer

# moe_model: three layers, 0 and 2 sparse (6 experts, top 2), 1 dense.
N_EXPERTS, TOP_K, MOE_LAYERS = 6, 2, 2
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def b64(ids: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(ids, dtype=np.uint8).tobytes()).decode()


def own_routes(model: torch.nn.Module, input_ids: list[int]) -> np.ndarray:
    """``[len - 1, MoE layers, k]``: the experts the model's packed forward routes the
    fed tokens (all but the last) to."""
    packed = PackedCausalLM(model)
    ids = torch.tensor(input_ids[:-1])
    with torch.no_grad():
        packed(ids, position_ids([len(ids)]), packed_seqs([len(ids)], "cpu"))
    return packed.recorded_routes().permute(1, 0, 2).numpy().astype(np.uint8)


def with_routes(its: list[SeqItem], model: torch.nn.Module, shift: int = 0) -> list[SeqItem]:
    """``its`` carrying the model's own routes (``shift``: every id + shift, mod E)."""
    for it in its:
        it.routes = b64((own_routes(model, it.input_ids).astype(np.int64) + shift) % N_EXPERTS)
    return its


# ---------------------------------------------------------------- the wire


def test_bytes_per_token_golden():
    # Qwen3-30B-A3B's shape: 48 MoE layers x top-8 of 128 experts: uint8, 48 * 8 = 384
    # bytes a token; base64 makes 3 tokens (1152 bytes) 1536 characters (4 per 3 bytes).
    ids = np.random.default_rng(0).integers(0, 128, (3, 48, 8))
    r = encode_routes(ids, inline_max_bytes=1 << 20, num_experts=128)
    assert (r.dtype, r.num_bytes, len(r.data_b64)) == ("uint8", 3 * 384, 1536)
    assert np.array_equal(decode_routes(r), ids)
    # More than 256 experts: uint16, 768 bytes a token.
    wide = encode_routes(np.full((1, 48, 8), 299), inline_max_bytes=1 << 20, num_experts=300)
    assert (wide.dtype, wide.num_bytes) == ("uint16", 768)
    assert int(decode_routes(wide).max()) == 299
    with pytest.raises(SchemaError, match=r"outside \[0, 128\)"):
        encode_routes(np.full((1, 2, 2), 128), inline_max_bytes=1 << 20, num_experts=128)


def test_routes_beyond_the_inline_limit_go_to_the_blob_store(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    small, large = np.ones((25, 2, 2)), np.ones((26, 2, 2))  # 100 and 104 bytes
    r = encode_routes(small, inline_max_bytes=100, store=store)
    assert r.data_b64 and not r.blob_sha256
    r = encode_routes(large, inline_max_bytes=100, store=store)
    assert r.blob_sha256 and not r.data_b64 and store.has(r.blob_sha256)
    assert np.array_equal(decode_routes(r, store), large)
    assert encode_routes(large, inline_max_bytes=100, store=store) == r  # idempotent, one blob
    path = tmp_path / "blobs" / r.blob_sha256[:2] / r.blob_sha256
    path.write_bytes(b"\x00" * 104)
    with pytest.raises(MissingBlobError, match="corrupted"):
        decode_routes(r, store)
    path.unlink()
    with pytest.raises(MissingBlobError, match="not in"):
        store.get(r.blob_sha256)


def trajectory(routes: RoutedExperts | None, prompt=(1, 2, 3), out=(4, 5)) -> TrajectoryEvent:
    return TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0, group_size=1,
                           prompt_ids=list(prompt), output_ids=list(out), output_logprobs=[-1.0] * len(out),
                           output_versions=[0] * len(out), routed_experts=routes)


def raw_trajectory(routes: dict) -> bytes:
    d = trajectory(None).to_dict()
    d["routed_experts"] = routes
    return orjson.dumps(d)


@pytest.mark.parametrize("routes, message", [
    # 3 prompt + 2 output tokens: 4 fed tokens (the last sampled one never is).
    ({"num_tokens": 5, "num_layers": 1, "top_k": 1, "data_b64": b64(np.zeros(5))},
     r"covers 5 tokens, but 3 prompt \+ 2 output tokens need 4"),
    ({"num_tokens": 4, "num_layers": 1, "top_k": 1, "data_b64": b64(np.zeros(3))},
     r"has 4 characters, but 4 tokens x 1 layers x top-1 in uint8 are 4 bytes, 8 in base64"),
    ({"num_tokens": 4, "num_layers": 1, "top_k": 1}, "needs exactly one of data_b64"),
    ({"num_tokens": 4, "num_layers": 1, "top_k": 1, "blob_sha256": "xyz"}, "not 64 lowercase hex"),
    ({"num_tokens": 4, "num_layers": 0, "top_k": 1, "data_b64": ""}, r"num_layers is 0"),
    ({"num_tokens": 4, "num_layers": 1, "top_k": 1, "dtype": "int8", "data_b64": b64(np.zeros(4))},
     "expected one of"),
])
def test_a_trajectory_with_inconsistent_routes_fails_decoding(routes, message):
    """The bus dead-letters what fails decoding: here, routes that cannot be the ids of
    this trajectory's tokens."""
    with pytest.raises(SchemaError, match=message):
        decode_event(raw_trajectory(routes))


def test_events_without_routes_decode_as_before():
    """An event written before routes existed has no routed_experts key: None."""
    d = trajectory(None).to_dict()
    del d["routed_experts"]
    assert decode_event(orjson.dumps(d)).routed_experts is None
    good = trajectory(encode_routes(np.zeros((4, 2, 2)), inline_max_bytes=1024))
    assert decode_event(encode_event(good)).routed_experts == good.routed_experts


# ---------------------------------------------------------------- the paged engine


def hf_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[len, MoE layers, k]``: HF's routers' top-k for ``ids`` (no cache)."""
    picked = {}
    layers = [0, 2]
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: picked.__setitem__(i, out[2])) for i in layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack([picked[i] for i in layers], 1)


def requests(n: int = 4, new: int = 6, seed: int = 0) -> list[GenRequest]:
    gen = torch.Generator().manual_seed(seed)
    reqs = [GenRequest(f"r{i}", torch.randint(1, VOCAB, (2 + 3 * i,), generator=gen).tolist(),
                       SamplingParams(temperature=1.0, max_new_tokens=new)) for i in range(n)]
    shared = torch.randint(1, VOCAB, (6,), generator=gen).tolist()
    # A group: one prompt, three samples (shared blocks, a copied partial block).
    return reqs + [GenRequest(f"g{i}", shared, SamplingParams(temperature=1.0, max_new_tokens=new))
                   for i in range(3)]


def assert_routes_are_hf(model, results) -> None:
    for r in results:
        seq = r.prompt_ids + r.output_ids
        got = torch.from_numpy(r.routed_experts.astype(np.int64))
        assert r.routed_experts.dtype == np.uint8 and got.shape == (len(seq) - 1, MOE_LAYERS, TOP_K)
        assert torch.equal(got.sort(-1).values, hf_routes(model, seq[:-1]).sort(-1).values), r.request_id


def test_paged_engine_records_the_routes_of_every_fed_token():
    """Every token the engine fed (prompt, then each sampled token but the last) with
    the experts HF's router picks for it, in every MoE layer: a group's samples (shared
    blocks and a copied partial block), prompts served from the prefix cache (their
    routes were written by the forward that computed them) and graph-bucket padding."""
    model = moe_model()
    with PagedEngine(model, seed=3, kv_block_size_tokens=4, max_batch_size=12, record_routes=True) as eng:
        eng.graphs.bucketed = True
        first = eng.generate(requests())
        again = eng.generate(requests(seed=0))  # the same prompts: prefix-cache hits
        assert eng.stats()["prefix_cache_hit_blocks"] > 0
    assert_routes_are_hf(model, first + again)
    with PagedEngine(model, seed=3, kv_block_size_tokens=4) as eng:
        assert eng.generate(requests(1))[0].routed_experts is None  # not asked for


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_records_the_same_routes_as_eager():
    """The routes of decode steps replayed as CUDA graphs (written by the graph itself)
    equal the eager engine's, greedy, fp32."""
    model = moe_model().to("cuda")
    reqs = [GenRequest(f"r{i}", [3 + i, 5, 7, 9][: 2 + i % 3], SamplingParams(temperature=0, max_new_tokens=12))
            for i in range(5)]  # 5 rows: a graph bucket of 8 (3 padding rows)
    routes = {}
    for graphs in (False, True):
        with PagedEngine(model, device="cuda", cuda_graphs=graphs, kv_block_size_tokens=4,
                         record_routes=True) as eng:
            results = eng.generate(reqs)
            assert (eng.stats()["cuda_graphs"] > 0) == graphs
        routes[graphs] = [(r.output_ids, r.routed_experts) for r in results]
    for (ids_e, eager), (ids_g, graph) in zip(routes[False], routes[True]):
        assert ids_e == ids_g and np.array_equal(np.sort(eager, -1), np.sort(graph, -1))


def test_torch_engine_refuses_to_record_routes():
    with pytest.raises(ConfigError, match="recorded by the paged engine"):
        in_process_engine(moe_model(), type("T", (), {"eos_token_id": None, "pad_token_id": 0})(),
                          RolloutConfig(paged=False), seed=0, decode=str, record_routes=True)


# ---------------------------------------------------------------- rollout and advantage


@pytest.mark.parametrize("inline_max_bytes", [1 << 20, 0])
def test_rollout_worker_puts_the_routes_on_each_trajectory(tmp_path, inline_max_bytes):
    model = moe_model()
    section = RolloutSection(gconfig=GenerationConfig(max_new_tokens=5), seed=0, record_routes=True,
                             run_dir=str(tmp_path),
                             rollout=RolloutConfig(routed_experts_inline_max_bytes=inline_max_bytes))
    with PagedEngine(model, seed=0, kv_block_size_tokens=4, record_routes=True) as eng:
        role = RolloutWorker(section, engine=eng, load_weights=lambda e: None, decode=str)
        state = role.init_state()
        role.handle(PromptEvent(group_id="g0", prompt_id="p", group_index=0, n_samples=2,
                                prompt_ids=[3, 4, 5, 6, 7]), state, Source("t.prompts.v1", 0, 0))
        out: list = []
        deadline = time.monotonic() + 60
        while len(out) < 2 and time.monotonic() < deadline:
            out += [e for e in role.on_tick(state, time.monotonic()) if isinstance(e, TrajectoryEvent)]
            time.sleep(0.01)
    store = FileBlobStore(tmp_path / "blobs")
    for t in out:
        r = t.routed_experts
        assert bool(r.blob_sha256) == (inline_max_bytes == 0)
        ids = decode_routes(r, store)
        assert ids.shape == (5 + len(t.output_ids) - 1, MOE_LAYERS, TOP_K)
        assert torch.equal(torch.from_numpy(ids.astype(np.int64)).sort(-1).values,
                           hf_routes(model, (t.prompt_ids + t.output_ids)[:-1]).sort(-1).values)
        decode_event(encode_event(t))  # valid on the wire


def test_advantage_processor_carries_the_routes_to_the_sample():
    proc = AdvantageProcessor(AdvantageSection(max_new_tokens=8, n_samples=2))
    state = proc.init_state()
    routes = [encode_routes(np.full((4, 2, 2), i), inline_max_bytes=1024) for i in range(2)]
    out = []
    for i, r in enumerate(routes):
        t = trajectory(r)
        t.traj_id, t.sample_index, t.group_size = f"g:{i}", i, 2
        out += proc.handle(t, state, Source("t.trajectories.v1", 0, i))
        out += proc.handle(RewardEvent(traj_id=f"g:{i}", group_id="g", reward=float(i)), state,
                           Source("t.rewards.v1", 0, i))
    (sample,) = out
    assert [s.routed_experts for s in sample.sequences] == routes
    (item0, item1) = flatten_groups([sample])
    assert item1.routes == routes[1].data_b64 and item1.routes_dtype == "uint8"


# ---------------------------------------------------------------- the trainer


def test_packed_batch_lays_out_each_sequences_routes_in_token_order():
    # Two sequences of 3 and 2 tokens: routes of tokens 0..1 and 0 (the last of each is
    # never fed), -1 for each last token, [layers, N = 5, k].
    a = SeqItem(group_id="g", input_ids=[1, 2, 3], prompt_len=1, behav_logprobs=[-1.0] * 2, versions=[0] * 2,
                loss_mask=[1] * 2, advantage=1.0, reward=0.0, routes=b64(np.arange(8).reshape(2, 2, 2)))
    b = SeqItem(group_id="g", input_ids=[4, 5], prompt_len=1, behav_logprobs=[-1.0], versions=[0],
                loss_mask=[1], advantage=1.0, reward=0.0)
    replay = to_packed([a, b], "cpu", (2, 2)).replay_topk_LNK
    assert replay.tolist() == [[[0, 1], [4, 5], [-1, -1], [-1, -1], [-1, -1]],
                               [[2, 3], [6, 7], [-1, -1], [-1, -1], [-1, -1]]]
    assert to_packed([a, b], "cpu").replay_topk_LNK is None


def test_r3_with_the_trainers_own_routes_is_the_plain_step_and_agrees_on_every_token():
    """Replaying the experts the trainer's router picks anyway changes nothing (same
    forward, same step), and the agreement is 100% of the replayed tokens: every token
    but each sequence's last (6 sequences)."""
    model = moe_model()
    its = with_routes(items(), model)
    plain = actor(moe_model())
    m0 = plain.train_step(items(), policy_version=0).metrics
    r3 = actor(moe_model(), moe=MoeConfig(router_replay="R3"))
    m3 = r3.train_step(its, policy_version=0).metrics
    assert m3["actor/loss"] == m0["actor/loss"]
    for k, v in plain.model.state_dict().items():
        assert torch.equal(v, r3.model.state_dict()[k]), k
    assert m3["actor/router_replay_tokens"] == sum(it.length - 1 for it in its)
    assert m3["actor/router_replay_agreement"] == 1.0
    assert "actor/router_replay_agreement" not in m0


def test_r3_trains_the_router_through_live_scores_at_the_rollouts_experts():
    """Routes other than the router's own: another forward (another loss), agreement 0,
    and the router still gets a gradient (its live probabilities at the replayed ids)."""
    model = moe_model()
    its = with_routes(items(), model, shift=1)  # every id + 1: never the same set of 2
    r3 = actor(moe_model(), moe=MoeConfig(router_replay="R3"))
    r3.optimizer.step = lambda: None  # keep the gradients
    m3 = r3.train_step(its, policy_version=0).metrics
    m0 = actor(moe_model()).train_step(items(), policy_version=0).metrics
    assert m3["actor/router_replay_agreement"] == 0.0 and m3["actor/loss"] != m0["actor/loss"]
    gate = r3.model.get_parameter("model.layers.0.mlp.gate.weight")
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_r2_replays_the_first_pass_in_later_minibatches():
    """Two minibatches: the second trains after the first's optimizer step, so its
    routes under R2 are those of its pi_prox forward (pre-update weights) -- the same
    step as R3 fed the trainer's own pre-update routes, and not the live one."""
    kw = dict(mb_max_tokens=32, ppo_n_minibatches=2)
    weights = {}
    for mode in ("disabled", "R2", "R3"):
        its = with_routes(items(), moe_model()) if mode == "R3" else items()
        a = actor(moe_model(), moe=MoeConfig(router_replay=mode), **kw)
        a.train_step(its, policy_version=0)
        weights[mode] = a.model.state_dict()
    for k, v in weights["R2"].items():
        torch.testing.assert_close(v, weights["R3"][k], rtol=0, atol=1e-7, msg=k)
    assert any(not torch.equal(v, weights["disabled"][k]) for k, v in weights["R2"].items())


def test_r2_records_routes_without_a_prox_forward_under_loglinear():
    """loglinear has no pi_prox forward: R2 runs a no-grad first pass over the later
    minibatches' micro-batches, for their routes only."""
    a = actor(moe_model(), moe=MoeConfig(router_replay="R2"), mb_max_tokens=32, ppo_n_minibatches=2,
              prox_logp_method="loglinear")
    no_grad_forwards = []
    a.packed.register_forward_hook(lambda *args: no_grad_forwards.append(not torch.is_grad_enabled()))
    mbs = a.micro_batches(items())
    later = len(mbs[1::2])
    a.train_micro_batches(mbs, policy_version=0)
    assert sum(no_grad_forwards) == later and len(no_grad_forwards) == len(mbs) + later
    assert all(mb.replay_topk_LNK is not None for mb in mbs[1::2])


def test_rollout_train_k3_kl_golden():
    # Behaviour logprobs = the trainer's own + 0.1: d = log pi_train - log pi_behav = -0.1
    # on every trained token, k3 = exp(-0.1) - 1 + 0.1 = 0.0048374, |d| = 0.1.
    its = items()
    a = actor(moe_model())
    for it in its:
        mb = a.micro_batches([it])[0]
        with torch.no_grad():
            lp, _ = a.logprobs(mb)
        it.behav_logprobs = (lp[mb.mask_BT] + 0.1).tolist()
    m = actor(moe_model()).train_step(its, policy_version=0).metrics
    assert m["actor/rollout_train_k3_kl"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-4)
    # |d| = 0.1 on every trained token: mean and max 0.1
    assert m["actor/rollout_train_abs_logprob_diff_mean"] == pytest.approx(0.1, rel=1e-4)
    assert m["actor/rollout_train_abs_logprob_diff_max"] == pytest.approx(0.1, rel=1e-4)


def test_router_replay_needs_a_model_with_moe_layers_on_the_packed_forward():
    from tapioca.models.factory import build_tiny_model

    with pytest.raises(ConfigError, match="router_replay=R3.*no MoE layer"):
        actor(build_tiny_model(VOCAB), moe=MoeConfig(router_replay="R3"))
    with pytest.raises(ConfigError, match="packed forward: set actor.packed_sequences=true"):
        ActorConfig(moe=MoeConfig(router_replay="R2"), packed_sequences=False)
    # Refused at load by the feature table; the actor keeps the same rule for direct callers.
    with pytest.raises(ConfigError, match=r"set one off \(feature table: router_replay_x_tree_training\)"):
        actor(moe_model(), moe=MoeConfig(router_replay="R3"), enable_tree_training=True)


# ---------------------------------------------------------------- bad and missing routes


def make_trainer(tmp_path, *, missing: str = "live") -> Trainer:
    cfg = ActorConfig(moe=MoeConfig(router_replay="R3", router_replay_missing=missing))
    section = TrainerSection(actor=cfg, model=ModelConfig(), max_head_offpolicyness=1, prompts_per_step=2,
                             total_train_steps=100, temperature=1.0, run_dir=str(tmp_path), seed=0,
                             stop_at_reward=None)
    return Trainer(section, actor=PPOActor(moe_model(), cfg, temperature=1.0, pad_token_id=0))


PROMPT = [1, 2, 4]


def sample(gid: str, routes: list[RoutedExperts | None]) -> SampleEvent:
    seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=[5 + i, 6, 7], behav_logprobs=[-2.7] * 3,
                           output_versions=[0] * 3, reward=float(i == 0), advantage=1.0 - 2 * (i % 2),
                           routed_experts=r) for i, r in enumerate(routes)]
    return SampleEvent(group_id=gid, prompt_id="p", prompt_ids=list(PROMPT), sequences=seqs)


def good(i: int = 0, **kw) -> RoutedExperts:
    shape = (kw.pop("tokens", len(PROMPT) + 3 - 1), kw.pop("layers", MOE_LAYERS), kw.pop("top_k", TOP_K))
    return encode_routes(np.full(shape, kw.pop("expert", i % N_EXPERTS)), inline_max_bytes=1 << 20, **kw)


def src(offset: int) -> Source:
    return Source("t.samples.v1", 0, offset)


@pytest.mark.parametrize("bad, message", [
    (good(expert=N_EXPERTS), "name expert 6, but the trainer.s model has 6 experts"),
    (good(layers=3), "are for 3 MoE layers x top-2, the trainer's model has 2 x top-2"),
    (good(top_k=3), "are for 2 MoE layers x top-3"),
    (good(tokens=4), r"cover 4 tokens; its 3 prompt \+ 3 output tokens need 5"),
])
def test_bad_routes_are_dead_lettered_and_the_trainer_goes_on(tmp_path, bad, message):
    t = make_trainer(tmp_path)
    state = t.init_state()
    list(t.on_tick(state, 0.0))
    t.handle(sample("g0", [good(0), good(1)]), state, src(0))
    with pytest.raises(BadEventError, match=message):
        t.handle(sample("bad", [good(0), bad]), state, src(1))
    assert state.dead_lettered == 1 and "bad" in state.rejected
    out = list(t.handle(sample("g1", [good(2), good(3)]), state, src(2)))
    assert state.progress.version == 1 and any(getattr(e, "group_ids", None) == ["g0", "g1"] for e in out)
    t.sink.close()


def test_missing_routes_are_rejected_or_routed_live_as_configured(tmp_path):
    t = make_trainer(tmp_path / "reject", missing="reject")
    state = t.init_state()
    with pytest.raises(BadEventError, match="carries no routed experts.*router_replay_missing=live"):
        t.handle(sample("g0", [good(0), None]), state, src(0))
    blob = RoutedExperts(num_tokens=5, num_layers=2, top_k=2, blob_sha256="ab" * 32)  # never stored
    with pytest.raises(BadEventError, match="blob store does not hold"):
        t.handle(sample("g1", [good(0), blob]), state, src(1))
    t.sink.close()
    t = make_trainer(tmp_path / "live")
    state = t.init_state()
    t.handle(sample("g0", [good(0), None]), state, src(0))
    rows = [e for e in t.handle(sample("g1", [blob, good(1)]), state, src(1)) if hasattr(e, "metrics")]
    # g0 and g1 make step 1: 2 of their 4 sequences routed live.
    (m,) = [r.metrics for r in rows]
    assert m["trainer/routes_missing"] == 2.0
    assert m["actor/router_replay_tokens"] == 2 * (len(PROMPT) + 3 - 1)
    t.sink.close()


def test_routes_in_the_blob_store_are_read_at_arrival(tmp_path):
    t = make_trainer(tmp_path)
    state = t.init_state()
    store = FileBlobStore(tmp_path / "blobs")  # the run's: <run dir>/blobs
    r = encode_routes(np.zeros((5, 2, 2)), inline_max_bytes=0, store=store)
    event = sample("g0", [r, good(1)])
    t.handle(event, state, src(0))
    assert event.sequences[0].routed_experts.data_b64 and not event.sequences[0].routed_experts.blob_sha256
    path = tmp_path / "blobs" / r.blob_sha256[:2] / r.blob_sha256
    path.write_bytes(b"\x01" * 20)
    with pytest.raises(BadEventError, match="cannot be read.*corrupted"):
        t.handle(sample("g1", [r, good(1)]), state, src(1))
    t.sink.close()


def test_an_archive_written_before_routes_replays_and_trains(tmp_path):
    """Samples archived by a writer that had no routed_experts field (the key absent
    from every payload) decode, replay and train: with R3 (routed live, counted) and
    without."""
    from tapioca.bus.archive import archive_row, iter_events, write_file

    rows = []
    for i in range(2):
        d = sample(f"g{i}", [None, None]).to_dict()
        for s in d["sequences"]:
            del s["routed_experts"]
        rows.append(archive_row(Source("t.samples.v1", 0, i), decode_event(orjson.dumps(d)), orjson.dumps(d)))
    write_file(tmp_path / "archive" / "t.samples.v1", rows)
    events = [e for _, e in iter_events(tmp_path / "archive")]
    assert len(events) == 2 and all(s.routed_experts is None for e in events for s in e.sequences)
    for replay in ("R3", "disabled"):
        t = make_trainer(tmp_path / replay) if replay == "R3" else Trainer(
            TrainerSection(actor=ActorConfig(), model=ModelConfig(), max_head_offpolicyness=1, prompts_per_step=2,
                           total_train_steps=100, temperature=1.0, run_dir=str(tmp_path / replay), seed=0,
                           stop_at_reward=None), actor=actor(moe_model()))
        state = t.init_state()
        out = [e for i, ev in enumerate(events) for e in t.handle(ev, state, src(i))]
        (m,) = [e.metrics for e in out if hasattr(e, "metrics")]
        assert state.progress.version == 1 and math.isfinite(m["actor/loss"])
        assert m.get("trainer/routes_missing") == (4.0 if replay == "R3" else None)
        t.sink.close()


# ---------------------------------------------------------------- server adapters


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A Qwen3-MoE config (3 hidden layers, layer 1 dense): what the adapters read."""
    d = tmp_path_factory.mktemp("moe")
    moe_model().config.save_pretrained(d)
    return str(d)


def test_vllm_adapter_takes_the_routes_of_each_choice_cut_to_the_moe_layers(stub_server, moe_dir):
    import io

    from test_engine_server_failover import config, vllm_routes

    from tapioca.engines.vllm_engine import VLLMEngine, vllm_command

    # vLLM 0.32: base64 of a .npy [prompt + output - 1, all 3 hidden layers, top_k].
    ids = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2) % N_EXPERTS
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    routes = vllm_routes("a")
    plain = routes["POST /inference/v1/generate"]

    def generate(body, query):
        status, out = plain(body, query)
        tokens = len(body["token_ids"]) + 3 - 1
        out["choices"][0]["routed_experts"] = base64.b64encode(buf.getvalue() if tokens == 5 else b"").decode()
        return status, out

    routes["POST /inference/v1/generate"] = generate
    server = stub_server(routes)
    eng = VLLMEngine([server.url], config=config(), model_path=moe_dir, return_routed_experts=True)
    try:
        (r, short) = eng.generate([GenRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=3)),
                                   GenRequest("b", [1, 2, 3, 4], SamplingParams(max_new_tokens=3))])
        assert np.array_equal(r.routed_experts, ids[:, [0, 2]])  # the MoE layers 0 and 2
        assert short.routed_experts is None  # none returned for it
    finally:
        eng.shutdown()
    cmd = vllm_command("python", moe_dir, port=1, dtype="float32", max_num_seqs=4, extra_args=[],
                       return_routed_experts=True)
    assert "--enable-return-routed-experts" in cmd


def test_sglang_adapter_asks_for_routes_and_refuses_a_wrong_shape(stub_server, moe_dir):
    from test_engine_sglang import SHAPES, sglang_routes

    from tapioca.engines.sglang_engine import SGLangEngine, sglang_command

    # SGLang: meta_info.routed_experts, base64 int32 [prompt + output - 1, 3 layers, top_k].
    ids = (np.arange(7 * 3 * 2, dtype="<i4") % N_EXPERTS).reshape(7, 3, 2)
    stop = dict(SHAPES["generate_response_stop"], output_ids=[11, 2])  # 2 tokens after 6: 7 fed
    ok = {**stop, "meta_info": {**stop["meta_info"], "routed_experts": base64.b64encode(ids.tobytes()).decode()}}
    bad = {**stop, "meta_info": {**stop["meta_info"], "routed_experts": base64.b64encode(ids[:3].tobytes()).decode()}}
    server = stub_server(sglang_routes({"a": ok, "b": bad}))
    from tapioca.config.servers import InferenceServerConfig

    eng = SGLangEngine([server.url], config=InferenceServerConfig(health_interval_s=0.2), model_path=moe_dir,
                       eos_token_ids=[2], return_routed_experts=True)
    try:
        prompt = [1, 5, 6, 7, 8, 9]
        (a, b) = eng.generate([GenRequest(rid, prompt, SamplingParams(max_new_tokens=5)) for rid in "ab"])
        sent = [body for key, body in server.calls if key == "POST /generate"]
        assert all(body["return_routed_experts"] is True for body in sent)
        assert np.array_equal(a.routed_experts, ids[:, [0, 2]])
        assert b.routed_experts is None and eng.describe()["routes_malformed"] == 1
    finally:
        eng.shutdown()
    cmd = sglang_command("python", moe_dir, port=1, dtype="float32", max_num_seqs=4, device="cuda", version=0,
                         extra_args=[], return_routed_experts=True)
    assert "--enable-return-routed-experts" in cmd
