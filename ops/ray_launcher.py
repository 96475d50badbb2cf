"""`tapioca train --launcher ray` (``scheduler.type: ray``): every role member a Ray actor.

Kafka stays the bus; Ray only places and supervises the processes. The run is set up
exactly as the local launcher does it (:class:`~tapioca.ops.launcher.Launcher`: the
run directory, the broker, the topics, the written config) and each member runs the
same command (:func:`~tapioca.ops.launcher.role_command`), but inside a Ray actor:

- ``ray.init()`` starts a private local Ray cluster on 127.0.0.1 (no dashboard; stopped
  with the run), or joins ``scheduler.ray_address`` (``auto`` or ``HOST:PORT``).
- A member is a :class:`RoleActor` reserving ``scheduler.num_cpus_per_role`` CPUs (and a
  GPU for a rollout worker on ``cuda``); its ``run`` starts the role's process and waits
  for it. The trainer with ``fsdp.world_size`` N takes its N GPUs (and N x CPUs) as one
  placement group (one STRICT_PACK bundle: its ranks talk over 127.0.0.1), and its
  process starts ranks 1..N-1 itself (trainers/fsdp_ranks.py).
- A member whose process dies (non-zero exit) ends its actor, and Ray restarts the
  actor (``scheduler.max_restarts``) and retries ``run``: the role resumes from the log
  and its checkpoint, as after any crash. A killed actor takes its process with it
  (parent-death signal). The launcher sees the new process id, counts the restart and
  reports it (``notices``: the live display's caption, and the closing line). A member
  out of restarts fails the run like a dead role of the local launcher.
- A clean exit (0) is a finished trainer or a drained member, as locally.

Logs: ``<run>/logs/<role>-<member>.log`` as with the local launcher (the actors run on
this host's file system; on a multi-node Ray cluster, use a shared run directory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ..bus.settings import BOOTSTRAP_ENV
from ..schemas.errors import EXIT_OOM, ConfigError, TapiocaError
from .launcher import EXIT_NO_RESTART, Child, Launcher, role_command

log = logging.getLogger(__name__)


class RayStartError(TapiocaError):
    """Ray failed to start, join or place the run (said in one line, with what to do)."""


@contextlib.contextmanager
def _ray_failure(what: str):
    """Ray's exception as one line: what failed, Ray's first line of why, where Ray's logs
    are, and the local launcher, which needs no Ray."""
    try:
        yield
    except TapiocaError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        tmp = os.environ.get("RAY_TMPDIR") or "/tmp"
        raise RayStartError(
            f"{what} ({type(exc).__name__}: {first}); Ray's logs: {tmp}/ray/session_latest/logs; "
            "to train without Ray use the local launcher: drop --launcher ray "
            "(scheduler.type=local)") from None


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("scheduler.type=ray needs the ray package: pip install 'tapioca-rl[ray]' "
                          "(or pip install ray)") from None
    return ray


class _RoleActorImpl:
    """One role member's process, inside a Ray actor (threaded, so ``info`` and ``stop``
    answer while ``run`` waits)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str) -> None:
        self.cmd, self.env, self.log_path = cmd, env, log_path
        self.proc: subprocess.Popen | None = None
        self.stopping = False

    def run(self) -> int:
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                         preexec_fn=_parent_death_only)
        code = self.proc.wait()
        if code not in (0, EXIT_NO_RESTART, EXIT_OOM) and not self.stopping:
            # End the actor: Ray restarts it (max_restarts) and retries run() there. A
            # config error or an out-of-memory step is returned instead: no restart fixes
            # it, the launcher says it.
            os._exit(code if 0 < code < 256 else 1)
        return code

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "child": self.proc.pid if self.proc else None}

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the role's process group (it flushes, commits, checkpoints), then kill."""
        self.stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        _killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(5)


def _parent_death_only() -> None:
    """The role dies with its actor (SIGKILL); unlike a trainer rank it keeps SIGTERM."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class RayProc:
    """A Ray actor's role process, seen through the Popen calls the launcher makes
    (``poll``, ``wait``, ``kill``, ``pid``), plus restart detection."""

    def __init__(self, ray, actor, label: str) -> None:
        self.ray, self.actor, self.label = ray, actor, label
        self.ref = actor.run.remote()
        self.returncode: int | None = None
        self.restarts = 0
        self._actor_pid: int | None = None
        self._info_ref = actor.info.remote()
        self.pid = -1

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._check_info()
        ready, _ = self.ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            self.returncode = int(self.ray.get(self.ref))
        except Exception as exc:  # out of restarts (RayActorError) or the task failed
            log.warning("%s: %s", self.label, exc)
            self.returncode = 1
        return self.returncode

    def _check_info(self) -> None:
        ready, _ = self.ray.wait([self._info_ref], timeout=0)
        if not ready:
            return
        try:
            info = self.ray.get(self._info_ref)
        except Exception:  # the actor is restarting: ask again next time
            self._info_ref = self.actor.info.remote()
            return
        if self._actor_pid is not None and info["pid"] != self._actor_pid:
            self.restarts += 1
        self._actor_pid = info["pid"]
        self.pid = info["child"] or -1
        self._info_ref = self.actor.info.remote()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.label, timeout)
            time.sleep(0.1)
        return self.returncode

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)


class RayLauncher(Launcher):
    """The local launcher's run, with every member placed and supervised by Ray."""

    def __init__(self, cfg, **kwargs) -> None:
        super().__init__(cfg, **kwargs)
        self.ray = _require_ray()
        self._own_cluster = False
        self._groups: list = []
        self._actor_cls = None
        self._seen_restarts: dict[str, int] = {}
        if not hasattr(self, "notices"):
            self.notices: list[str] = []
        s = cfg.scheduler
        if s.ray_address and not cfg.bus.bootstrap_servers:
            raise ConfigError("scheduler.ray_address joins a Ray cluster whose nodes must all "
                              "reach the broker: set bus.bootstrap_servers (the embedded broker "
                              "listens on 127.0.0.1 of this host only)")

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        self._init_ray()
        super().start()

    def _init_ray(self) -> None:
        ray, s = self.ray, self.cfg.scheduler
        if ray.is_initialized():
            return
        # Ray's own driver logging only with --debug: the live table is the display.
        quiet = dict(log_to_driver=False, logging_level=logging.DEBUG
                     if logging.getLogger().isEnabledFor(logging.DEBUG) else logging.ERROR)
        if s.ray_address:
            with _ray_failure(f"could not join the Ray cluster at scheduler.ray_address="
                              f"{s.ray_address}"):
                ray.init(address=s.ray_address, **quiet)
            return
        from .launcher import role_counts

        # Logical CPUs: enough for every member whatever this host has (the roles
        # share its cores as they do under the local launcher).
        need = sum(n * s.num_cpus_per_role * (self.cfg.fsdp.world_size if role == "trainer" else 1)
                   for role, n in role_counts(self.cfg))
        with _ray_failure("Ray could not start its local node on 127.0.0.1"):
            ray.init(num_cpus=max(int(need + 0.999), os.cpu_count() or 1), include_dashboard=False,
                     _node_ip_address="127.0.0.1", object_store_memory=128 * 1024 * 1024,
                     **quiet)
        self._own_cluster = True

    def _actor_class(self):
        if self._actor_cls is None:
            self._actor_cls = self.ray.remote(_RoleActorImpl)
        return self._actor_cls

    def _spawn(self, role: str, member: int, config_path: Path) -> Child:
        log_path = Path(self.cfg.run_path) / "logs" / f"{role}-{member}.log"
        s = self.cfg.scheduler
        env = {BOOTSTRAP_ENV: self.cfg.bus.bootstrap_servers, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", **s.extra_env}
        options: dict[str, Any] = dict(
            name=f"{self.cfg.run_id}:{role}-{member}:{time.time_ns()}", max_restarts=s.max_restarts,
            max_task_retries=-1, max_concurrency=4, num_cpus=s.num_cpus_per_role, num_gpus=0)
        if role == "trainer":
            options.update(self._trainer_placement())
        elif role in ("rollout", "proxy", "evaluator") and self.cfg.rollout.device.startswith("cuda"):
            srv = self.cfg.rollout.server
            # A member that launches a tensor-parallel server needs that server's GPUs (the
            # evaluator launches its own: it refuses rollout.server.urls, runtime/builders.py).
            launches = self.cfg.rollout.engine != "torch" and not srv.urls
            options["num_gpus"] = s.rollout_num_gpus * (srv.tensor_parallel_size if launches else 1)
        actor = self._actor_class().options(**options).remote(
            role_command(role, member, config_path), env, str(log_path))
        child = Child(role, member, RayProc(self.ray, actor, f"{role}-{member}"), log_path)
        self.children.append(child)
        return child

    def _trainer_placement(self) -> dict[str, Any]:
        """The trainer's N ranks: N GPUs (on cuda) and N x CPUs as one placement group."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = self.cfg.fsdp.world_size
        cpus = self.cfg.scheduler.num_cpus_per_role * n
        gpus = n if self.cfg.actor.device.startswith("cuda") else 0
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{self.cfg.run_id}:trainer")
        with _ray_failure(f"Ray could not place the trainer's {bundle} on one node within "
                          f"scheduler.start_timeout_s={self.cfg.scheduler.start_timeout_s:.0f} s"):
            self.ray.get(pg.ready(), timeout=self.cfg.scheduler.start_timeout_s)
        self._groups.append(pg)
        return dict(num_cpus=cpus, num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=0))

    # ------------------------------------------------------------------ supervision

    def wait(self, timeout_s: float | None = None):
        # Restarts are seen by RayProc.poll (called by the launcher's loop); they are
        # reported through on_metrics, which the display redraws on.
        on_metrics = self.on_metrics

        def observe(row: dict) -> None:
            self._report_restarts()
            if on_metrics is not None:
                on_metrics(row)

        self.on_metrics = observe
        try:
            return super().wait(timeout_s)
        finally:
            self.on_metrics = on_metrics
            self._report_restarts()

    def _report_restarts(self) -> None:
        for child in self.children:
            proc = child.proc
            if not isinstance(proc, RayProc):
                continue
            proc.poll()
            seen = self._seen_restarts.get(child.label, 0)
            if proc.restarts > seen:
                self._seen_restarts[child.label] = proc.restarts
                note = f"{child.label} restarted by Ray ({proc.restarts}x)"
                log.warning(note)
                self.notices.append(note)

    @property
    def restart_counts(self) -> dict[str, int]:
        return dict(self._seen_restarts)

    def restart(self, role: str, member: int = 0, *, kill: bool = True) -> Child:
        """Kill a member's actor as a crash would; Ray restarts it."""
        child = next(c for c in self.children if c.role == role and c.member == member)
        self.ray.kill(child.proc.actor, no_restart=False)
        return child

    # ------------------------------------------------------------------ stop

    def _stop_children(self, children: list[Child], timeout_s: float) -> None:
        ray = self.ray
        pending = [(c, c.proc.actor.stop.remote(timeout_s)) for c in children
                   if isinstance(c.proc, RayProc) and c.proc.returncode is None]
        for child, ref in pending:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except Exception as exc:  # already gone, or stuck: killed below
                log.info("stopping %s: %s", child.label, exc)
        for child in children:
            if isinstance(child.proc, RayProc):
                try:
                    ray.kill(child.proc.actor, no_restart=True)
                except Exception:
                    pass

    def stop(self, timeout_s: float = 15.0) -> None:
        try:
            super().stop(timeout_s)
        finally:
            ray = self.ray
            if ray.is_initialized():
                from ray.util.placement_group import remove_placement_group

                for pg in self._groups:
                    try:
                        remove_placement_group(pg)
                    except Exception:
                        pass
                self._groups = []
                if self._own_cluster:
                    ray.shutdown()  # a private cluster stops with its driver
