"""Sleep mode (rollout.enable_sleep_mode, engines/kv_memory.py): an idle paged engine gives
its KV cache's memory back and takes it again for the next request, with the same
results as an engine that never sleeps.

On the CPU the buffer's storage is resized to nothing and back (its address changes);
on CUDA the driver's virtual memory keeps the address, so the decode graphs stay valid
(the CUDA tests at the end; they run on the GPU box).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from tapioca.config.device_defaults import resolve_device_defaults
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig, kv_tokens_needed
from tapioca.engines import GenRequest, SamplingParams
from tapioca.engines.block_manager import plan_num_blocks
from tapioca.engines.kv_memory import SleepableBuffer, sleepable_buffer
from tapioca.engines.paged_engine import PagedEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CUDA = torch.cuda.is_available()


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def requests(tag: str) -> list[GenRequest]:
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    return [GenRequest(request_id=f"{tag}{i}", prompt_ids=[1 + i, 2, 3, 4 + i, 5], sampling=greedy)
            for i in range(4)]


def wait_asleep(eng: PagedEngine, timeout_s: float = 60.0) -> None:
    """Until the engine has slept since its last request (it also sleeps right after it
    starts: no KV memory is taken before the first request)."""
    deadline = time.monotonic() + timeout_s
    while not eng._kv_mem.asleep:
        assert time.monotonic() < deadline, f"the idle engine did not sleep ({eng.sleeps} sleeps)"
        time.sleep(0.01)


def test_an_idle_engine_releases_its_kv_cache_and_a_new_request_gets_the_same_tokens(tmp_path):
    device = "cuda" if CUDA else "cpu"
    awake = PagedEngine(tiny().to(device), device=device, kv_block_size_tokens=4, cuda_graphs=CUDA)
    sleepy = PagedEngine(tiny().to(device), device=device, kv_block_size_tokens=4, cuda_graphs=CUDA,
                         sleep_mode=True)
    try:
        want = [r.output_ids for r in awake.generate(requests("a"))]
        assert [r.output_ids for r in sleepy.generate(requests("b"))] == want
        slept = sleepy.sleeps
        wait_asleep(sleepy)
        assert sleepy.sleeps == slept + 1
        if not sleepy._kv_mem.keeps_address:
            assert sleepy._kv_mem.tensor.untyped_storage().nbytes() == 0, "the memory was not given back"
        # woken by the next request: same tokens (the cache was zeroed and rebuilt)
        assert [r.output_ids for r in sleepy.generate(requests("c"))] == want
        wait_asleep(sleepy)
        assert sleepy.sleeps == slept + 2
        # a weight update while asleep, then a request: still right
        sleepy.update_weights(tiny(seed=1).state_dict(), version=1)
        awake.update_weights(tiny(seed=1).state_dict(), version=1)
        want = [r.output_ids for r in awake.generate(requests("d"))]
        got = sleepy.generate(requests("e"))
        assert [r.output_ids for r in got] == want and all(set(r.output_versions) == {1} for r in got)
        assert sleepy.sleep_s >= 0
    finally:
        awake.shutdown()
        sleepy.shutdown()


def test_an_engine_without_sleep_mode_never_sleeps():
    eng = PagedEngine(tiny(), device="cpu", kv_block_size_tokens=4)
    try:
        eng.generate(requests("a"))
        time.sleep(0.3)
        assert eng.sleeps == 0 and eng._kv_mem is None
    finally:
        eng.shutdown()


def test_the_cpu_buffer_keeps_its_views_across_release_and_restore():
    buf = sleepable_buffer(4000, torch.device("cpu"))
    assert type(buf) is SleepableBuffer and not buf.keeps_address
    assert buf.nbytes == 4096  # rounded up to the granularity, as the CUDA driver's is
    view = buf.tensor.view(torch.float32).view(4, 256)
    view.fill_(3.0)
    buf.release()
    assert buf.tensor.untyped_storage().nbytes() == 0
    buf.restore()
    assert view.shape == (4, 256) and float(view.abs().sum()) == 0.0  # zeroed, same views
    view.fill_(1.0)
    assert float(buf.tensor.view(torch.float32).sum()) == 1024.0


def test_the_kv_cache_is_sized_from_the_rollouts_need():
    # 256 rows x 512 new tokens + 32 groups x a 2048-token prompt
    assert kv_tokens_needed(256, 512, 8) == 256 * 512 + 32 * 2048
    assert kv_tokens_needed(3, 10, 2) == 30 + 2 * 2048
    if CUDA:
        dev = torch.device("cuda")
        block_bytes = 1 << 20
        n = plan_num_blocks(dev, block_bytes=block_bytes, block_size=16, cache_tokens=0, memory_fraction=0.5,
                            cpu_default_tokens=0, need_tokens=16 * 10)
        assert n == 11  # the need (10 blocks + the null block), far below the fraction


def test_auto_picks_the_fast_path_on_a_shared_gpu_and_the_exact_one_on_the_cpu():
    def cfg(*overrides: str) -> TrainConfig:
        return load_config(TrainConfig, None, list(overrides))

    def picked(c: TrainConfig) -> tuple:
        return c.actor.param_dtype, c.weights.transport, c.rollout.enable_sleep_mode

    gpu = cfg("actor.device=cuda", "rollout.device=cuda")
    assert picked(gpu) == ("bfloat16", "ipc", True)
    assert picked(cfg()) == ("float32", "file", False)
    # a value the user set is kept; separate GPUs: no sleep
    assert picked(cfg("actor.device=cuda:1", "rollout.device=cuda:0", "actor.param_dtype=float32",
                      "weights.transport=file")) == ("float32", "file", False)
    # FSDP keeps fp32 shards; an inference server reads files
    assert cfg("actor.device=cuda", "fsdp.world_size=2").actor.param_dtype == "float32"
    assert cfg("actor.device=cuda", "rollout.device=cuda", "rollout.engine=vllm",
               "gconfig.top_p=1").weights.transport == "file"
    assert resolve_device_defaults(gpu) == {}  # resolved once: nothing left to resolve


@pytest.mark.skipif(not CUDA, reason="CUDA virtual memory: the GPU box runs this")
def test_cuda_release_frees_device_memory_and_restore_keeps_the_address_for_a_graph():
    dev = torch.device("cuda")
    nbytes = 1 << 30
    buf = sleepable_buffer(nbytes, dev)
    assert buf.keeps_address, "cuda-bindings' virtual memory should be used on the GPU box"
    x = buf.tensor.view(torch.float32)
    ptr = x.data_ptr()
    out = torch.zeros(1, device=dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(x[:1024].sum().view(1))  # warm-up
        with torch.cuda.graph(g):
            out.copy_(x[:1024].sum().view(1))
    torch.cuda.current_stream().wait_stream(s)
    x[:1024].fill_(2.0)
    g.replay()
    assert float(out) == 2048.0
    free_before = torch.cuda.mem_get_info()[0]
    buf.release()
    freed = torch.cuda.mem_get_info()[0] - free_before
    assert freed >= 0.9 * nbytes, f"release gave back {freed / 2**20:.0f} MiB of {nbytes / 2**20:.0f}"
    buf.restore()
    assert x.data_ptr() == ptr and float(x.abs().sum()) == 0.0
    x[:1024].fill_(3.0)
    g.replay()  # the graph captured before the sleep reads the restored memory
    assert float(out) == 3072.0
    buf.close()
