"""The weight transports' protocols on CPU (weights/): the flat layout and its
checksum (golden values from plain modular arithmetic), file, ipc over /dev/shm (in this
process and from another one), nccl over gloo with readers in threads (late join, a
version the trainer no longer holds, a slow worker dropped without blocking publish),
the durable writer, and the rollout worker dead-lettering a corrupt transfer. No broker.
CUDA variants skip without a GPU."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tapioca.bus.role import Source
from tapioca.config.schema import GenerationConfig
from tapioca.config.sections import RolloutSection
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.torch_engine import TorchEngine
from tapioca.models.factory import build_tiny_model
from tapioca.producers.rollout import RolloutWorker
from tapioca.schemas.envelope import decode_event, encode_event
from tapioca.schemas.errors import BadEventError
from tapioca.schemas.events import DlqRecord, WeightsEvent
from tapioca.weights import WeightPublisher, WeightReceiver, make_weight_loader
from tapioca.weights.files import WeightsTransferError, WeightsUnavailableError, sha256_file
from tapioca.weights.layout import ALIGN_BYTES, Layout, bucket_checksums
from tapioca.weights.payload import load_verified
from tapioca.weights.slots import SlotBuffer

VOCAB = 16
BUCKET = 8192  # several buckets even for the tiny model


def tiny(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    return build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_position_embeddings=64, seed=seed,
                            dtype=dtype)


def bump(model: torch.nn.Module, by: float = 1.0) -> None:
    """A stand-in for an optimizer step: every version has different bytes."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def event(fields: dict, version: int) -> WeightsEvent:
    """As a reader sees it: through the wire format."""
    return decode_event(encode_event(WeightsEvent(version=version, **fields)))


def assert_same(got: dict, model: torch.nn.Module, dtype=torch.float32) -> None:
    own = model.state_dict()
    assert got, "no tensors"
    for name, t in got.items():
        assert torch.equal(t, own[name].to(dtype)), name


@pytest.fixture
def publishers():
    made: list[WeightPublisher] = []

    def make(transport: str, directory: Path, **kw) -> WeightPublisher:
        kw.setdefault("publish_dtype", torch.float32)
        kw.setdefault("bucket_bytes", BUCKET)
        pub = WeightPublisher(transport, directory, device="cpu", **kw)
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


# ---------------------------------------------------------------------- layout + checksum

def _reference_checksum(data: bytes) -> str:
    """The documented formula in plain Python integers: s1 = sum of all little-endian
    int64 words mod 2**64; s2 = sum over 4 KiB rows r (1-based) of r * (row sum) mod 2**64."""
    mask = (1 << 64) - 1
    words = [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    rows = [sum(words[i:i + 512]) for i in range(0, len(words), 512)]
    s1 = sum(rows) & mask
    s2 = sum((r + 1) * rs for r, rs in enumerate(rows)) & mask
    return f"{s1:016x}{s2:016x}"


def test_checksum_matches_the_formula_with_wrapping_sums():
    rng = random.Random(0)
    data = bytes(rng.getrandbits(8) for _ in range(3 * ALIGN_BYTES))
    data += b"\xff" * ALIGN_BYTES  # every word -1, and
    data += (0x7FFF_FFFF_FFFF_FFFF).to_bytes(8, "little") * 512  # sums that overflow int64
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got = bucket_checksums(buf, len(data), 2 * ALIGN_BYTES)
    expected = [_reference_checksum(data[i:i + 2 * ALIGN_BYTES])
                for i in range(0, len(data), 2 * ALIGN_BYTES)]
    assert got == expected and len(got) == 3


def test_checksum_catches_a_changed_byte_and_swapped_rows():
    buf = torch.randint(0, 256, (4 * ALIGN_BYTES,), dtype=torch.uint8)
    base = bucket_checksums(buf, buf.numel(), buf.numel())
    flipped = buf.clone()
    flipped[5000] ^= 1
    swapped = buf.clone()
    swapped[:ALIGN_BYTES], swapped[ALIGN_BYTES:2 * ALIGN_BYTES] = (
        buf[ALIGN_BYTES:2 * ALIGN_BYTES].clone(), buf[:ALIGN_BYTES].clone())
    assert bucket_checksums(flipped, buf.numel(), buf.numel()) != base
    assert bucket_checksums(swapped, buf.numel(), buf.numel()) != base


def test_layout_packs_tied_weights_once_aligned_and_writes_valid_safetensors(tmp_path):
    model = tiny()
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    sd = {**sd, "counter": torch.arange(3, dtype=torch.int64), "flag": torch.ones(3, dtype=torch.bool)}
    layout, sources = Layout.from_state_dict(sd, torch.bfloat16)
    names = [e.name for e in layout.entries]
    assert "lm_head.weight" not in names and len(names) == len(sd) - 1
    assert all(e.offset % e.torch_dtype.itemsize == 0 for e in layout.entries)
    assert layout.padded_bytes % ALIGN_BYTES == 0 and layout.padded_bytes >= layout.data_bytes
    buf = torch.zeros(layout.padded_bytes, dtype=torch.uint8)
    layout.pack(buf, sources)
    views = layout.views(buf)
    assert views["counter"].dtype == torch.int64 and views["flag"].dtype == torch.bool
    assert views["model.norm.weight"].dtype == torch.bfloat16
    path = tmp_path / "w.safetensors"
    path.write_bytes(layout.safetensors_header() + buf[:layout.data_bytes].numpy().tobytes())
    loaded = load_file(str(path))
    assert loaded.keys() == views.keys()
    assert all(torch.equal(loaded[k], views[k]) for k in views)
    assert Layout.from_event(layout.to_event()).fingerprint() == layout.fingerprint()


# ---------------------------------------------------------------------- file

def test_file_transport_writes_once_with_sha256_and_keeps_the_last_versions(tmp_path, publishers):
    model = tiny()
    pub = publishers("file", tmp_path, keep_versions=2)
    rec = WeightReceiver("cpu")
    for v in range(4):
        bump(model)
        fields = pub.publish(model.state_dict(), v)
        assert fields["transport"] == "file" and sha256_file(fields["path"]) == fields["sha256"]
        assert_same(rec.fetch(event(fields, v)), model)
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == [
        "v000002.safetensors", "v000003.safetensors"]
    assert pub.poll() == []  # nothing in the background for the file transport


# ---------------------------------------------------------------------- ipc (shm on CPU)

def test_ipc_shm_round_trip_double_buffered_and_durable_files_after(tmp_path, publishers):
    model = tiny()
    pub = publishers("ipc", tmp_path)
    rec = WeightReceiver("cpu")
    got, files = {}, []
    for v in range(3):
        bump(model)
        fields = pub.publish(model.state_dict(), v)
        assert fields["path"] == "" and fields["sha256"] == ""
        assert fields["transport_info"]["kind"] == "shm" and fields["transport_info"]["slot"] == v % 2
        assert len(fields["bucket_checksums"]) == -(-fields["data_bytes"] // BUCKET)
        got[v] = {k: t.clone() for k, t in rec.fetch(event(fields, v)).items()}
        assert_same(got[v], model)
        files += pub.poll()  # starts the durable write of v, after its event
    files += pub.finish(2)
    # Every version has its file unless the writer was behind (then the newest wins).
    assert len(files) + pub.writer.skipped == 3 and files[-1].version == 2
    assert_same(load_verified(files[-1].path, files[-1].sha256), model)  # the same bytes


def test_ipc_reader_of_an_overwritten_version_gets_unavailable_then_falls_back_to_the_file(
        tmp_path, publishers):
    model = tiny()
    pub = publishers("ipc", tmp_path, buffer_slots=2)
    rec = WeightReceiver("cpu")
    old = pub.publish(model.state_dict(), 0)
    bump(model)
    pub.publish(model.state_dict(), 1)
    bump(model)
    pub.publish(model.state_dict(), 2)  # slot 0 now holds version 2
    with pytest.raises(WeightsUnavailableError, match="holds version 2"):
        rec.fetch(event(old, 0))
    # With a verified file named in the event, the reader loads that instead.
    pub.poll()
    files = pub.finish(2)
    f = next(f for f in files if f.version == 2)
    fields = {**pub.announcement(2, f.path, f.sha256)}
    fields["transport_info"] = {**fields["transport_info"], "shm_path": "/nonexistent/x.slots"}
    assert_same(rec.fetch(event(fields, 2)), model)
    assert rec.file_loads == 1


def test_ipc_corrupt_byte_is_a_transfer_error_and_the_engine_keeps_its_weights(tmp_path, publishers):
    model = tiny()
    pub = publishers("ipc", tmp_path)
    bump(model)
    fields = pub.publish(model.state_dict(), 1)
    pub.slots.slot(1)[100] ^= 0xFF  # a bit flip in the trainer's buffer after publishing
    engine = TorchEngine(tiny(), seed=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    load = make_weight_loader(engine, "cpu")
    try:
        with pytest.raises(WeightsTransferError, match=r"bucket\(s\) \[0\]"):
            load(event(fields, 1))
        assert engine.version == 0
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    finally:
        engine.shutdown()


def _as_bytes(tensors: dict) -> bytes:
    """Tensors through a multiprocessing queue as plain bytes (not shared file
    descriptors, which need the sending process alive)."""
    import io

    out = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()}, out)
    return out.getvalue()


def _from_bytes(raw: bytes) -> dict:
    import io

    return torch.load(io.BytesIO(raw))


def _map_and_fetch(fields_json: bytes, queue) -> None:
    """In another process: map the trainer's shm buffer and fetch a version."""
    rec = WeightReceiver("cpu")
    queue.put(_as_bytes(rec.fetch(decode_event(fields_json))))


def test_ipc_shm_from_another_process(tmp_path, publishers):
    model = tiny()
    pub = publishers("ipc", tmp_path)
    bump(model)
    fields = pub.publish(model.state_dict(), 1)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_map_and_fetch, args=(encode_event(WeightsEvent(version=1, **fields)),
                                                    queue))
    proc.start()
    try:
        # Wait on the child, not on a clock: a spawned process imports torch and the test
        # module first, which took over 120 s on a loaded 2-core box. A child that dies
        # without a result fails at once; a live one gets 15 minutes.
        deadline = time.monotonic() + 900
        raw = None
        while raw is None:
            try:
                raw = queue.get(timeout=1.0)
            except queue_mod.Empty:
                assert proc.is_alive() or not queue.empty(), f"the reader died (exit code {proc.exitcode})"
                assert time.monotonic() < deadline, "the reader is still running after 15 minutes"
        got = _from_bytes(raw)
    finally:
        proc.join(120)
    assert proc.exitcode == 0
    assert_same(got, model)


# ---------------------------------------------------------------------- nccl over gloo

def test_nccl_gloo_pull_two_readers_late_join_and_bitwise(tmp_path, publishers):
    model = tiny()
    pub = publishers("nccl", tmp_path, transfer_timeout_s=20)
    first = WeightReceiver("cpu", member="a")
    bump(model)
    fields = pub.publish(model.state_dict(), 1)
    assert fields["transport_info"]["backend"] == "gloo"
    assert_same(first.fetch(event(fields, 1)), model)
    bump(model)
    fields = pub.publish(model.state_dict(), 2)
    late = WeightReceiver("cpu", member="b")  # joins after two versions were published
    results = {}

    def fetch(name, rec):
        results[name] = {k: v.clone() for k, v in rec.fetch(event(fields, 2)).items()}

    threads = [threading.Thread(target=fetch, args=(n, r)) for n, r in (("a", first), ("b", late))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_same(results["a"], model)
    assert_same(results["b"], model)
    assert first.fast_loads == 2 and late.fast_loads == 1
    deadline = time.monotonic() + 10  # the sender counts after its last broadcast returns
    while pub.server.served < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.server.served == 3
    first.close()
    late.close()


def test_nccl_version_no_longer_held_is_unavailable(tmp_path, publishers):
    model = tiny()
    pub = publishers("nccl", tmp_path, buffer_slots=1, transfer_timeout_s=20)
    rec = WeightReceiver("cpu", member="a")
    old = pub.publish(model.state_dict(), 1)
    bump(model)
    new = pub.publish(model.state_dict(), 2)
    with pytest.raises(WeightsUnavailableError, match="no longer holds version 1"):
        rec.fetch(event(old, 1))
    assert_same(rec.fetch(event(new, 2)), model)  # same connection, no back-off
    rec.close()


def test_nccl_slow_worker_is_dropped_without_blocking_the_trainer(tmp_path, publishers):
    from torch.distributed import PrefixStore, TCPStore

    from tapioca.weights.nccl import make_group

    model = tiny()
    # The slow worker is dropped when the send to it times out: 5 s after its request, long
    # enough for four tiny publishes on a loaded box, short enough for a quick test.
    pub = publishers("nccl", tmp_path, transfer_timeout_s=5)
    fields = pub.publish(model.state_dict(), 1)
    host, _, port = fields["transport_info"]["store"].rpartition(":")
    # A worker that joins and asks for version 1, then never receives it.
    store = TCPStore(host, int(port), is_master=False)
    index = store.add("joined", 1) - 1
    store.set(f"join/{index}", "slow")
    holder = {}
    joiner = threading.Thread(target=lambda: holder.setdefault("pg", make_group(
        PrefixStore(f"pg/{index}", store), 1, "gloo", 2, "127.0.0.1", torch.device("cpu"))))
    joiner.start()
    joiner.join(30)
    store.set(f"req/{index}/1", "1")
    for v in range(2, 6):  # the trainer goes on publishing meanwhile
        bump(model)
        fields = pub.publish(model.state_dict(), v)
    # An order, not a stopwatch: every publish returned before the send to the slow worker
    # timed out, so none waited for it (one that did would return only after the drop).
    assert pub.server.dropped == 0, "a publish waited for the slow worker's transfer timeout"
    deadline = time.monotonic() + 60
    while pub.server.dropped < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pub.server.dropped == 1
    holder.clear()
    # A healthy worker is served the current version meanwhile and afterwards.
    rec = WeightReceiver("cpu", member="ok")
    assert_same(rec.fetch(event(fields, 5)), model)
    rec.close()


# ---------------------------------------------------------------------- durable writer

def test_durable_writer_skips_a_torn_slot_and_writes_every_kth_version(tmp_path, publishers):
    from tapioca.weights.durable import DurableWriter

    model = tiny()
    layout, sources = Layout.from_state_dict(model.state_dict(), torch.float32)
    slots = SlotBuffer("host", 1, layout.padded_bytes, torch.device("cpu"))
    slots.begin_write(0)
    layout.pack(slots.slot(0), sources)
    slots.end_write(0, 7)
    writer = DurableWriter(tmp_path)
    gen = slots.gen[0]
    slots.begin_write(0)  # rewritten after the job was taken: the file would be torn
    assert writer._write(7, layout, slots, 0, gen) is None
    assert not list(tmp_path.glob("*.safetensors")) and writer.skipped == 1
    writer.close()

    pub = publishers("ipc", tmp_path / "k", file_every_versions=2)
    for v in range(1, 6):
        bump(model)
        pub.publish(model.state_dict(), v)
        pub.poll()
    written = sorted(f.version for f in pub.finish(5))
    assert set(written) <= {2, 4, 5} and 5 in written  # every 2nd, and the final one


# ---------------------------------------------------------------------- the rollout worker

def test_rollout_worker_dead_letters_a_corrupt_transfer_and_keeps_its_version(tmp_path, publishers):
    trainer_model = tiny(seed=1)
    pub = publishers("ipc", tmp_path)
    engine = TorchEngine(tiny(), seed=0, max_batch_size=4)
    role = RolloutWorker(RolloutSection(gconfig=GenerationConfig(max_new_tokens=2), seed=0),
                         engine=engine, load_weights=make_weight_loader(engine, "cpu"), decode=str)
    state = role.init_state()
    try:
        fields = pub.publish(trainer_model.state_dict(), 1)
        pub.slots.slot(1)[7] ^= 0x10
        bad = event(fields, 1)
        src = Source(topic="t.weights.v1", partition=0, offset=11, broadcast=True)
        assert list(role.handle(bad, state, src)) == []
        # The tick's load fails: a BadEventError naming the weights event, which the bus
        # retries with backoff, then dead-letters (tests/integration/test_bus.py), and
        # tells the role (on_dead_letter). The engine keeps its weights meanwhile.
        with pytest.raises(BadEventError, match="arrived corrupt over ipc") as failed:
            role.on_tick(state, time.time())
        assert failed.value.event is bad and failed.value.source == src
        assert isinstance(failed.value.__cause__, WeightsTransferError)
        assert state.loaded_version == 0 == engine.version
        assert role.describe(state)["weight_load_failures"] == 1
        role.on_dead_letter(state, bad, failed.value)
        assert role.describe(state)["weights_dead_lettered"] == 1
        # The next version arrives intact and is loaded.
        bump(trainer_model)
        good = event(pub.publish(trainer_model.state_dict(), 2), 2)
        role.handle(good, state, Source(topic="t.weights.v1", partition=0, offset=12))
        assert [e for e in role.on_tick(state, time.time()) if isinstance(e, DlqRecord)] == []
        assert state.loaded_version == 2 == engine.version
        assert_same(engine.model.state_dict(), trainer_model)
    finally:
        engine.shutdown()


def test_engine_switches_versions_mid_generation_from_the_transport_buffer(tmp_path, publishers):
    """The update lands at a step boundary of a running generation (the fetch runs in the
    loading thread, not the engine's): one sequence carries both versions."""
    trainer_model = tiny(seed=1)
    pub = publishers("ipc", tmp_path)
    engine = TorchEngine(tiny(), seed=0, max_batch_size=4, interruptible=True)
    load = make_weight_loader(engine, "cpu")
    ev = event(pub.publish(trainer_model.state_dict(), 1), 1)
    calls, loader = [0], []

    def hook(module, args, output):  # at the 4th forward, load and hold until it waits
        calls[0] += 1
        if calls[0] == 4:
            loader.append(threading.Thread(target=load, args=(ev,)))
            loader[0].start()
            deadline = time.monotonic() + 30
            while engine._update_waiters == 0 and time.monotonic() < deadline:
                time.sleep(0.001)

    handle = engine.model.register_forward_hook(hook)
    try:
        result = engine.generate([GenRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=12))])[0]
        loader[0].join(30)
        assert engine.version == 1
        versions = result.output_versions
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), versions
        assert_same(engine.model.state_dict(), trainer_model)
    finally:
        handle.remove()
        engine.shutdown()


@pytest.mark.parametrize("transport", ["file", "ipc", "nccl"])
def test_moe_expert_tensors_move_over_every_transport_into_the_paged_engine(tmp_path, publishers, transport):
    """Qwen3-MoE's fused 3-D expert tensors and its router travel like any tensor: the
    paged engine holds the trainer's bytes after the load (its router as an fp32 copy)."""
    from tapioca.engines.paged_engine import PagedEngine

    def moe(seed):
        return build_tiny_model(VOCAB, arch="qwen3_moe", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                intermediate_size=64, num_experts=4, moe_intermediate_size=16,
                                max_position_embeddings=64, seed=seed)

    trainer_model = moe(1)
    shapes = {k: tuple(v.shape) for k, v in trainer_model.state_dict().items() if ".experts." in k}
    assert shapes == {"model.layers.0.mlp.experts.gate_up_proj": (4, 32, 32),
                      "model.layers.0.mlp.experts.down_proj": (4, 32, 16)}
    pub = publishers(transport, tmp_path, **({"transfer_timeout_s": 20} if transport == "nccl" else {}))
    with PagedEngine(moe(0), kv_block_size_tokens=4) as engine:
        load = make_weight_loader(engine, "cpu")
        load(event(pub.publish(trainer_model.state_dict(), 1), 1))
        assert engine.version == 1
        assert_same(engine.decoder.hf_state_dict(), trainer_model)
        load.receiver.close()


# ---------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_checksum_is_the_same_on_gpu_and_cpu():
    buf = torch.randint(0, 256, (64 * ALIGN_BYTES,), dtype=torch.uint8)
    assert bucket_checksums(buf.cuda(), buf.numel(), 16 * ALIGN_BYTES) == bucket_checksums(
        buf, buf.numel(), 16 * ALIGN_BYTES)


def _cuda_reader(payload: bytes, queue) -> None:
    rec = WeightReceiver("cuda")
    queue.put(_as_bytes(rec.fetch(decode_event(payload))))


@needs_cuda
def test_ipc_cuda_handle_from_another_process(tmp_path):
    model = tiny().cuda()
    pub = WeightPublisher("ipc", tmp_path, device="cuda", publish_dtype=torch.bfloat16,
                          bucket_bytes=BUCKET)
    try:
        bump(model)
        fields = pub.publish(model.state_dict(), 1)
        assert fields["transport_info"]["kind"] == "cuda"
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_cuda_reader,
                           args=(encode_event(WeightsEvent(version=1, **fields)), queue))
        proc.start()
        got = _from_bytes(queue.get(timeout=120))
        proc.join(60)
        assert proc.exitcode == 0
        assert_same(got, model.cpu(), dtype=torch.bfloat16)
    finally:
        pub.close()
