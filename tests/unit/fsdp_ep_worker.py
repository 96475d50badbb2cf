"""One rank of the expert-parallel test (tests/unit/test_expert_parallel.py), run as a script
with torchrun's environment and the output directory as its argument; the test imports
its builders to run the same step in one plain process.

Scenarios, each on a fresh tiny Qwen3-MoE (fp32 compute): ``ep2`` (the experts of each
MoE layer split over the 2 ranks, tokens by all-to-all), ``dp`` (FSDP2 only) and
``ep2_r3`` (EP 2 replaying given routes), all with the z-loss on and
the load-balancing loss off (why: the test's docstring). Per
scenario one sharded step, the full gradients and weights gathered; for ``ep2`` also a
sharded checkpoint, a second step, the checkpoint loaded back and the second step again
(the same weights bit for bit), and a rollback (whole weights in). Rank 0 writes
``result.json`` and ``tensors.safetensors``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

VOCAB = 40


def make_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def make_cfg(**moe_overrides):
    from tapioca.config.moe import MoeConfig
    from tapioca.config.schema import ActorConfig

    # A budget of 40 tokens gives several micro-batches. The default lr and clipping (both
    # sides clip by the same global norm), so the test reads the same on either name of
    # the optimizer settings.
    return ActorConfig(mb_max_tokens=40, moe=MoeConfig(z_loss_coeff=0.01, **moe_overrides))


def make_items(step: int = 0):
    from tapioca.trainers.batching import SeqItem

    rng = random.Random(200 + step)
    items = []
    for i in range(11):
        pl, ol = rng.randint(1, 5), rng.randint(2, 9)
        items.append(SeqItem(group_id=f"g{i // 4}", input_ids=[rng.randrange(1, VOCAB) for _ in range(pl + ol)],
                             prompt_len=pl, behav_logprobs=[-rng.uniform(2, 4) for _ in range(ol)],
                             versions=[0] * ol, loss_mask=[1] * ol, advantage=rng.uniform(-1, 1), reward=0.0))
    return items


def with_routes(items):
    """``items`` carrying routes for routing replay R3: those a plain packed forward of
    the model gives (every token but the last, as an engine records them), each id
    moved to the next expert, so that replaying them is not what the router does anyway."""
    import base64

    import numpy as np

    from tapioca.models.attention import packed_seqs, position_ids
    from tapioca.models.packed import PackedCausalLM

    packed = PackedCausalLM(make_model())
    for it in items:
        ids = torch.tensor(it.input_ids[:-1])
        with torch.no_grad():
            packed(ids, position_ids([len(ids)]), packed_seqs([len(ids)], "cpu"))
        routes = ((packed.recorded_routes().permute(1, 0, 2) + 1) % 6).numpy().astype(np.uint8)
        it.routes = base64.b64encode(routes.tobytes()).decode()
    return items


# name, expert_parallel_size, actor.moe overrides (R3: the items carry their routes)
SCENARIOS = (("ep2", 2, {}), ("dp", 1, {}), ("ep2_r3", 2, {"router_replay": "R3"}))


def main(out_dir: str) -> None:
    from fsdp_worker import full_grads, rank_channel  # beside this script (its directory is on sys.path)
    from safetensors.torch import save_file

    from tapioca.config.distributed import FSDPConfig
    from tapioca.trainers.checkpoint import TrainerProgress
    from tapioca.trainers.fsdp_actor import ShardedActor

    info, channel = rank_channel()
    world = info.world_size
    tensors: dict[str, torch.Tensor] = {}
    results: dict = {}
    for name, ep, overrides in SCENARIOS:
        fsdp = FSDPConfig(world_size=world, param_dtype="float32", expert_parallel_size=ep)
        actor = ShardedActor(make_model(), make_cfg(**overrides), fsdp, channel=channel, temperature=1.0,
                             pad_token_id=0, device=torch.device("cpu"))
        items = with_routes(make_items(0)) if overrides.get("router_replay") == "R3" else make_items(0)
        experts = actor.model.model.layers[0].mlp.experts.gate_up_proj

        def command(method, *args, **kwargs):
            # Rank 0 calls the actor's API; the others run the one command it broadcasts.
            if info.leader:
                return method(*args, **kwargs)
            actor._run(channel.broadcast())
            return None

        result = command(actor.train_step, items, policy_version=0)
        grads = full_grads(actor.model)
        weights1 = command(actor.full_state_dict)
        if info.leader:  # EP: the (edp, ep) mesh of models/expert_parallel.py; DP: FSDP2's
            results[name] = {"metrics": result.metrics, "local_experts": tuple(experts.to_local().shape),
                             "expert_mesh": list(experts.device_mesh.mesh_dim_names or ())}
            tensors.update({f"{name}.grad.{k}": v for k, v in grads.items()})
            tensors.update({f"{name}.w1.{k}": v.contiguous() for k, v in weights1.items()})
        if name != "ep2":
            continue
        ckpt = Path(out_dir) / "checkpoints" / "trainer.pt"
        command(actor.save_checkpoint, ckpt, TrainerProgress(version=1))
        command(actor.train_step, make_items(1), policy_version=1)
        weights2 = command(actor.full_state_dict)
        command(actor.load_checkpoint, ckpt)
        command(actor.train_step, make_items(1), policy_version=1)
        weights2_again = command(actor.full_state_dict)
        command(actor.load_full_state_dict, weights1)
        rolled_back = command(actor.full_state_dict)
        if info.leader:
            results["restored_equal"] = all(torch.equal(weights2[k], v) for k, v in weights2_again.items())
            results["rollback_equal"] = all(torch.equal(rolled_back[k], v) for k, v in weights1.items())
    if info.leader:
        channel.broadcast({"op": "stop"})
        save_file(tensors, str(Path(out_dir) / "tensors.safetensors"))
        (Path(out_dir) / "result.json").write_text(json.dumps(results))
    else:
        ShardedActor.serve(actor)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # past gloo's teardown at exit: see fsdp_worker.exit_now
