"""``rollout.server``: how a rollout worker (or the agent proxy) reaches an inference
server when ``rollout.engine`` is ``vllm`` or ``sglang`` (engines/vllm_engine.py,
engines/sglang_engine.py, docs/inference-servers.md).

Either ``urls`` names running servers (several are load-balanced, least in-flight
requests first), or it is empty and the role launches one server itself with
``python`` (the server's own venv) on ``rollout.device``, with the flags Tapioca needs
plus ``extra_args``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schemas.errors import require_config as _require

ENGINES = ("torch", "vllm", "sglang")
# The servers' own spellings of tensor parallelism (vLLM, SGLang).
TP_FLAGS = ("--tensor-parallel-size", "-tp", "--tp-size", "--tp")


@dataclass(frozen=True, kw_only=True)
class InferenceServerConfig:
    # Running servers, e.g. ["http://10.0.0.5:8000"]. Empty: launch one per role process.
    urls: list[str] = field(default_factory=list)
    # The Python of the server's own venv (vLLM and SGLang pin their own torch and
    # transformers). Empty: .venv-vllm/bin/python or .venv-sglang/bin/python under the
    # current directory (`make venv-vllm` builds the first).
    python: str = ""
    # Flags appended to the launch command (e.g. ["--enforce-eager"]).
    extra_args: list[str] = field(default_factory=list)
    # GPUs of one launched server (vLLM --tensor-parallel-size, SGLang --tp-size): a model
    # beyond one GPU. A worker on rollout.device cuda:K launches it on GPUs K .. K+N-1
    # (plain "cuda": the CUDA_VISIBLE_DEVICES it has, else 0 .. N-1).
    tensor_parallel_size: int = 1
    # Port of a launched server; 0 = a free one.
    port: int = 0
    # Launched vLLM on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_gib: int = 1
    # A launched server must answer /health within this long (vLLM on 2 CPU cores: ~40-90 s).
    startup_timeout_s: float = 600.0
    # One generate call, from send to the last byte.
    request_timeout_s: float = 600.0
    # Connect + admin calls (pause, reload, version, abort).
    admin_timeout_s: float = 120.0
    # A request that failed on a server (connection refused or reset, 5xx) is sent again,
    # to another live server when there is one, up to this many times in total ...
    max_attempts: int = 4
    # ... after retry_backoff_s * 2**(attempt - 1) seconds.
    retry_backoff_s: float = 0.5
    # Every server is probed (GET /health) this often; a dead one is reported on
    # fleet.v1 (servers_down) and brought to the current weights when it comes back.
    health_interval_s: float = 5.0
    # With every server down, requests wait this long for one to come back; then they
    # fail (the rollout worker stops without committing their prompts: nothing is lost).
    wait_for_server_s: float = 300.0
    # Requests in flight per server (the server batches them); 0 = rollout.max_batch_size.
    max_inflight_per_server: int = 0
    # actor.lora.enabled: the largest adapter rank an engine accepts (a launched server's
    # --max-lora-rank; the in-process engines refuse larger adapters too), and the adapter
    # versions a server keeps loaded (0: max_head_offpolicyness + 2; older ones are unloaded).
    max_lora_rank: int = 64
    max_loaded_loras: int = 0

    def __post_init__(self) -> None:
        _require(self.max_lora_rank >= 1, "rollout.server.max_lora_rank must be >= 1")
        _require(self.max_loaded_loras >= 0,
                 "rollout.server.max_loaded_loras must be >= 0 (0: max_head_offpolicyness + 2)")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        _require(not bad, f"rollout.server.urls {bad}: give full URLs, e.g. "
                 "http://127.0.0.1:8000")
        _require(0 <= self.port <= 65535, "rollout.server.port must be in [0, 65535] (0 = free)")
        _require(self.cpu_kv_cache_gib >= 1, "rollout.server.cpu_kv_cache_gib must be >= 1")
        for name in ("startup_timeout_s", "request_timeout_s", "admin_timeout_s",
                     "health_interval_s", "wait_for_server_s"):
            _require(getattr(self, name) > 0, f"rollout.server.{name} must be > 0")
        _require(self.max_attempts >= 1, "rollout.server.max_attempts must be >= 1")
        _require(self.retry_backoff_s >= 0, "rollout.server.retry_backoff_s must be >= 0")
        _require(self.tensor_parallel_size >= 1, "rollout.server.tensor_parallel_size must be >= 1")
        given = [a for a in self.extra_args if a.split("=")[0] in TP_FLAGS]
        _require(self.tensor_parallel_size == 1 or not given,
                 f"rollout.server.extra_args has {given[0] if given else ''} and "
                 f"rollout.server.tensor_parallel_size={self.tensor_parallel_size}: set one of them")
        _require(self.tensor_parallel_size == 1 or not self.urls,
                 f"rollout.server.tensor_parallel_size={self.tensor_parallel_size} applies to servers Tapioca "
                 "launches, but rollout.server.urls names running ones: start those with "
                 "--tensor-parallel-size (vLLM) / --tp-size (SGLang) and leave tensor_parallel_size at 1")
        _require(self.max_inflight_per_server >= 0,
                 "rollout.server.max_inflight_per_server must be >= 0 (0 = max_batch_size)")
