"""trainers/sharded_checkpoint.py on one gloo rank (in process, CPU): a save that fails
part-way leaves the previous checkpoint loadable, and the record's errors say what to do.

The two-rank round trip (FSDP2 shards, resharding) is tested in test_fsdp_trainer.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tapioca.schemas.errors import TapiocaError
from tapioca.trainers import sharded_checkpoint
from tapioca.trainers.checkpoint import TrainerProgress
from tapioca.trainers.fsdp_ranks import Channel, RankInfo, free_port

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def channel():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    port = free_port("127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield Channel(dist.group.WORLD, RankInfo(0, 1, 0, "127.0.0.1", port))
    finally:
        dist.destroy_process_group()


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # Adam has moments to save
    return model, opt


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("next_version", [1, 2], ids=["same-version", "next-version"])
def test_a_save_failing_midway_keeps_the_previous_checkpoint_loadable(channel, tmp_path, monkeypatch,
                                                                      next_version):
    ckpt = tmp_path / "checkpoints" / "trainer.pt"
    model, opt = trained(0)
    sharded_checkpoint.save(ckpt, 1, model, opt, channel, TrainerProgress(version=1, offsets={"t:0": 5}))
    saved = snapshot(model, opt)
    record = sharded_checkpoint.read_record(ckpt)

    # Train on, then a save (the same version again, as on_stop after a periodic save, or the
    # next one) dies after part of the shards are on disk.
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    real_save = dcp.save

    def save_then_die(state, storage_writer):
        real_save(state, storage_writer=storage_writer)
        raise OSError("disk full (injected)")

    monkeypatch.setattr(dcp, "save", save_then_die)
    with pytest.raises(OSError, match="injected"):
        sharded_checkpoint.save(ckpt, next_version, model, opt, channel,
                                TrainerProgress(version=next_version, offsets={"t:0": 9}))
    monkeypatch.setattr(dcp, "save", real_save)

    assert sharded_checkpoint.read_record(ckpt) == record
    fresh, fresh_opt = trained(1)  # other weights and moments, overwritten by the load
    sharded_checkpoint.load(ckpt, record["shards"], fresh, fresh_opt, channel)
    assert_same(snapshot(fresh, fresh_opt), saved)

    # The next good save replaces it and deletes every other directory (the half-written one).
    sharded_checkpoint.save(ckpt, next_version, model, opt, channel,
                            TrainerProgress(version=next_version, offsets={"t:0": 9}))
    new = sharded_checkpoint.read_record(ckpt)
    assert new["progress"]["version"] == next_version and new["shards"] != record["shards"]
    dirs = sorted(p.name for p in (ckpt.parent / sharded_checkpoint.SHARDS_DIR).iterdir())
    assert dirs == [new["shards"].split("/")[-1]]


@pytest.mark.parametrize("damage,says", [
    (lambda rec, path: path.write_text("{not json"), "cannot be read"),
    (lambda rec, path: path.write_text(json.dumps({**rec, "format": "other-v9"})), "not a Tapioca sharded"),
    (lambda rec, path: (path.parent / rec["shards"] / "extra.json").unlink(), "missing or incomplete"),
], ids=["corrupt", "other-format", "shards-gone"])
def test_a_record_that_cannot_be_resumed_says_what_to_do(channel, tmp_path, damage, says):
    ckpt = tmp_path / "checkpoints" / "trainer.pt"
    model, opt = trained(0)
    sharded_checkpoint.save(ckpt, 1, model, opt, channel, TrainerProgress(version=1))
    path = sharded_checkpoint.progress_path(ckpt)
    damage(sharded_checkpoint.read_record(ckpt), path)
    with pytest.raises(TapiocaError, match=says) as info:
        sharded_checkpoint.read_record(ckpt)
    assert "move" in str(info.value) and "from scratch" in str(info.value)
