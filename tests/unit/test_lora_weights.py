"""A LoRA run's weights path: the base's identity, the PEFT adapter directory and its sha256,
and the adapter (its tensors only) over the ipc and nccl transports into an engine.

- ``base_identity``: equal for two directories with the same files, different when one
  tensor changes, refused for a directory without safetensors files.
- The directory's sha256 covers ``adapter_config.json`` then ``adapter_model.safetensors``:
  a changed config byte is caught like a changed tensor byte.
- ipc (shared memory on the CPU) and nccl (gloo) carry exactly the adapter's tensors
  (nothing of the base), their durable copy is the PEFT directory, and a paged engine
  loads the version through the rollout worker's loader (the event's ``adapter``).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tapioca.config.lora import LoraSpec
from tapioca.engines.paged_engine import PagedEngine
from tapioca.models.factory import build_tiny_model
from tapioca.models.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    adapter_config,
    adapter_config_bytes,
    adapter_state_dict,
    apply_lora,
)
from tapioca.schemas.envelope import decode_event, encode_event
from tapioca.schemas.errors import ConfigError
from tapioca.schemas.events import WeightsAdapter, WeightsEvent
from tapioca.weights import WeightPublisher, WeightReceiver, make_weight_loader
from tapioca.weights.adapter_files import adapter_sha256, load_verified_adapter, write_adapter_tensors
from tapioca.weights.base_id import base_identity
from tapioca.weights.durable import AdapterFiles
from tapioca.weights.files import WeightsChecksumError
from tapioca.weights.payload import load_verified

VOCAB = 16
BUCKET = 4096 * 4
SPEC = LoraSpec(peft_type="lora", rank=4, alpha=8, target_modules=("all-linear",), name="lora",
                max_rank=8, max_loaded=3)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "model"
    build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position_embeddings=64, tie_word_embeddings=False).save_pretrained(d)
    return d


def test_base_identity_names_the_files_bytes(base_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(base_dir, copy)
    assert base_identity(copy) == base_identity(base_dir)
    tensors = load_file(copy / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] += 1e-3  # one element of a fine-tune
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert base_identity(copy) != base_identity(base_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="safetensors"):
        base_identity(tmp_path / "empty")


def trainer_model(base_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    targets = apply_lora(model, rank=SPEC.rank, alpha=SPEC.alpha, target_modules=SPEC.target_modules)
    return model, targets


def bump(model, by: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(by)


def test_the_directory_sha256_covers_config_and_tensors(base_dir, tmp_path):
    model, targets = trainer_model(base_dir)
    bump(model, 0.1)
    doc = adapter_config(rank=4, alpha=8, targets=targets, base_model_path=str(base_dir))
    d = tmp_path / "lora-v3"
    sha, size = write_adapter_tensors(d, adapter_config_bytes(doc), adapter_state_dict(model))
    raw = (d / ADAPTER_CONFIG_FILE).read_bytes() + (d / ADAPTER_MODEL_FILE).read_bytes()
    assert sha == hashlib.sha256(raw).hexdigest() == adapter_sha256(d) and size == len(raw)
    tensors, config = load_verified_adapter(d, sha)
    assert config["r"] == 4 and set(tensors) == set(adapter_state_dict(model))
    assert set(load_verified(d, sha)) == set(tensors)  # a directory reads as its adapter
    config_file = d / ADAPTER_CONFIG_FILE
    config_file.write_bytes(config_file.read_bytes().replace(b'"r": 4', b'"r": 8'))
    with pytest.raises(WeightsChecksumError, match="lora-v3 has sha256 .* torn or was replaced"):
        load_verified(d, sha)


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_fast_transports_carry_the_adapter_only_into_the_engine(base_dir, tmp_path, transport):
    model, targets = trainer_model(base_dir)
    doc = adapter_config(rank=4, alpha=8, targets=targets, base_model_path=str(base_dir))
    pub = WeightPublisher(transport, tmp_path / "weights", device="cpu", publish_dtype=torch.float32,
                          bucket_bytes=BUCKET, transfer_timeout_s=20,
                          adapter=AdapterFiles("lora", adapter_config_bytes(doc)))
    from transformers import AutoModelForCausalLM

    engine = PagedEngine(AutoModelForCausalLM.from_pretrained(base_dir).eval(), kv_block_size_tokens=4)
    load = make_weight_loader(engine, "cpu", lora=SPEC, model_path=str(base_dir))
    try:
        files = []
        for v in (1, 2):
            bump(model, 0.05)
            own = adapter_state_dict(model)
            fields = pub.publish(own, v)
            assert {t.name for t in fields["tensors"]} == set(own)  # nothing of the base
            assert fields["data_bytes"] == sum(t.numel() * t.element_size() for t in own.values())
            e = decode_event(encode_event(WeightsEvent(version=v, **fields, adapter=WeightsAdapter(
                name=f"lora-v{v}", rank=4, alpha=8.0, target_modules=targets, base_id=base_identity(base_dir)))))
            load(e)
            assert engine.version == v
            got = load.receiver.fetch(e)
            assert all(torch.equal(got[k], own[k]) for k in own)
            files += pub.poll()
        files += pub.finish(2)
        assert files and files[-1].version == 2
        d = files[-1].path
        assert d.endswith("lora-v2") and adapter_sha256(d) == files[-1].sha256
        tensors, _ = load_verified_adapter(d, files[-1].sha256)
        assert all(torch.equal(tensors[k], v) for k, v in adapter_state_dict(model).items())
    finally:
        load.receiver.close()
        pub.close()
        engine.shutdown()


def test_receiver_alone_fetches_adapter_tensors_from_a_directory_event(base_dir, tmp_path):
    model, targets = trainer_model(base_dir)
    pub = WeightPublisher("file", tmp_path / "weights", device="cpu", publish_dtype=torch.float32,
                          adapter=AdapterFiles("lora", adapter_config_bytes(adapter_config(
                              rank=4, alpha=8, targets=targets, base_model_path=str(base_dir)))))
    try:
        fields = pub.publish(adapter_state_dict(model), 0)
        assert fields["path"].endswith("lora-v0")
        got = WeightReceiver("cpu").fetch(WeightsEvent(version=0, **fields))
        assert set(got) == set(adapter_state_dict(model))
    finally:
        pub.close()
