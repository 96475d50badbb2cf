"""One rank of the sharded LoRA test (tests/unit/test_lora_fsdp.py), run as a script with
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the output
directory as its argument; the test imports its builders to run the same step in one
plain process.

Every rank: a ShardedActor training a LoRA adapter (fp32, FSDP2 over gloo): one step on
the same batch as fsdp_worker.py, the adapter gathered (what a version publishes) and the
whole model gathered (its base must be untouched); a sharded checkpoint, a second step,
the checkpoint loaded back and the second step again; then a rollback to the first
step's adapter. Rank 0 writes ``result.json`` and ``tensors.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker as base_worker  # noqa: E402

from tapioca.config.lora import LoraSpec  # noqa: E402
from tapioca.config.policy import PolicySpec  # noqa: E402

SPEC = LoraSpec(peft_type="lora", rank=4, alpha=8, target_modules=("all-linear",), name="lora",
                max_rank=64, max_loaded=3)


def make_cfg():
    from tapioca.config.lora import LoraConfig

    return base_worker.make_cfg(lora=LoraConfig(enabled=True, rank=SPEC.rank, alpha=SPEC.alpha))


def main(out_dir: str) -> None:
    from safetensors.torch import save_file

    from tapioca.config.distributed import FSDPConfig
    from tapioca.models.lora import base_state_dict
    from tapioca.trainers.checkpoint import TrainerProgress
    from tapioca.trainers.fsdp_actor import ShardedActor
    from tapioca.trainers.fsdp_ranks import Channel, init_process_groups, rank_from_env

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    info = rank_from_env(FSDPConfig(world_size=world))
    channel = Channel(init_process_groups(FSDPConfig(world_size=world, timeout_s=300), info,
                                          torch.device("cpu")), info)
    fsdp = FSDPConfig(world_size=world, param_dtype="float32")
    model = base_worker.make_model()
    base0 = {k: v.clone() for k, v in base_state_dict(model).items()} if info.leader else {}
    actor = ShardedActor(model, make_cfg(), fsdp, channel=channel, temperature=1.0, pad_token_id=0,
                         device=torch.device("cpu"), policy=PolicySpec(adapter=SPEC))

    def command(method, *args, **kwargs):
        # Rank 0 calls the actor's API; the others run the one command it broadcasts.
        if info.leader:
            return method(*args, **kwargs)
        actor._run(channel.broadcast())
        return None

    tensors: dict[str, torch.Tensor] = {}
    result = command(actor.train_step, base_worker.make_items(0), policy_version=0)
    grads = base_worker.full_grads(actor.model)
    adapter1 = command(actor.publish_state_dict)
    whole = command(actor.full_state_dict)
    ckpt = Path(out_dir) / "checkpoints" / "trainer.safetensors"
    command(actor.save_checkpoint, ckpt, TrainerProgress(version=1))
    command(actor.train_step, base_worker.make_items(1), policy_version=1)
    adapter2 = command(actor.publish_state_dict)
    command(actor.load_checkpoint, ckpt)
    command(actor.train_step, base_worker.make_items(1), policy_version=1)
    adapter2_again = command(actor.publish_state_dict)
    command(actor.load_publish_state_dict, adapter1)
    rolled_back = command(actor.publish_state_dict)
    if info.leader:
        from safetensors import safe_open

        results = {"metrics": result.metrics, "applied": result.applied_minibatches,
                   "base_unchanged": all(torch.equal(base0[k], v) for k, v in base_state_dict_of(whole).items()),
                   "base_names": sorted(base_state_dict_of(whole)) == sorted(base0),
                   "rollback_equal": all(torch.equal(rolled_back[k], v) for k, v in adapter1.items()),
                   "files": sorted(str(p.relative_to(ckpt.parent)) for p in ckpt.parent.rglob("*"))}
        shard_keys = []
        for f in ckpt.parent.rglob("*.safetensors"):
            with safe_open(str(f), framework="pt") as st:
                shard_keys += list(st.keys())
        results["shard_keys"] = shard_keys
        tensors.update({f"grad.{k}": v for k, v in grads.items()})
        tensors.update({f"a1.{k}": v.contiguous() for k, v in adapter1.items()})
        tensors.update({f"a2.{k}": v.contiguous() for k, v in adapter2.items()})
        tensors.update({f"a2again.{k}": v.contiguous() for k, v in adapter2_again.items()})
        channel.broadcast({"op": "stop"})
        save_file(tensors, str(Path(out_dir) / "tensors.safetensors"))
        (Path(out_dir) / "result.json").write_text(json.dumps(results))
    else:
        ShardedActor.serve(actor)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def base_state_dict_of(sd: dict) -> dict:
    """A gathered state dict's base tensors under their transformers names."""
    return {k.replace(".base_layer.", "."): v for k, v in sd.items() if ".lora_" not in k}


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # past gloo's teardown at exit: see fsdp_worker.exit_now
