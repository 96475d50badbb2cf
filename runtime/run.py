"""Resolving a run before (and while) its processes run: the one place a loaded config
changes.

Consumes a loaded, frozen config (a :class:`~tapioca.config.schema.TrainConfig` or a
supervised :class:`~tapioca.config.supervised.SupervisedTrainConfig`) and the facts of this start
(the broker's address, the trial to name, the bus run id a resumed run continues on, ...);
returns a new config built with ``dataclasses.replace`` (each changed section validated
by its own ``__post_init__``) and makes what the new values name: the run directory, the
tiny model, the run's signing key, the proxy's admin key file. Emits nothing on the bus;
:func:`resolve_bus_run_id` reads ``weights.v1`` (keyed by run id) to tell whether the
broker still holds a resumed run's log.

Every caller that used to assign to a config (`tapioca train`'s launcher, `tapioca proxy`,
the supervised trainers, `tapioca train-offline`, `tapioca role`) calls :func:`resolve_run`
instead; nothing else changes a config after :func:`~tapioca.config.loader.load_config`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, TypeVar

from ..config.features import check_features
from ..config.policy import policy_of_arch, resolve_policy
from ..config.schema import TrainConfig, next_bus_run_id
from ..schemas.envelope import names_a_run
from ..schemas.errors import ConfigError

log = logging.getLogger(__name__)

C = TypeVar("C")

PROXY_KEY_FILE_NAME = "proxy-admin.key"


def replace_path(cfg: C, dotted: str, value: Any) -> C:
    """A copy of ``cfg`` with the field at ``dotted`` (``"bus.run_id"``) set to ``value``:
    ``dataclasses.replace`` down the path, so each section on it is validated again."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace_path(getattr(cfg, head), rest, value)})


def resolve_run(cfg: C, *, values: Mapping[str, Any] | None = None, trial_name: str | None = None,
                bootstrap: str | None = None, topic_prefix: str | None = None,
                client_id: str | None = None, prepare: bool = False, claim_run: bool = False,
                bus_run_id: str | None = None, signing_key: bool = False,
                proxy_endpoint: bool = False) -> C:
    """``cfg`` resolved for this start, in this order (every step optional but the trial):

    - ``values``: dotted keys set as given (a command's fixed choices, e.g. offline RL's
      ``rollout.max_head_offpolicyness``);
    - the trial: ``trial_name`` if given; an empty one names a new trial by the start
      time, so the run id and run dir are ``experiment.YYYYmmdd-HHMMSS``;
    - ``bootstrap`` / ``topic_prefix`` / ``client_id`` of the bus;
    - ``prepare``: the run directory made absolute and created, the tiny model created
      under it when ``model.path`` is empty (the task's alphabet), the feature table
      (config/features.py) checked with the model's facts (the datasets' image paths
      before all that: :func:`check_datasets`), an empty
      ``vlm.image_store`` set to ``<run dir>/images``, and ``bus.run_id`` set to the run
      id (a run's own log; the launcher then resolves a resumed run's);
    - ``claim_run``: a ``bus.run_id`` that names no run becomes the run id (a process that
      is its run's only writer, e.g. `tapioca proxy` on its own);
    - ``bus_run_id``: the run id on the bus, as given (one per broker lifetime);
    - ``signing_key``: the run's HMAC key file (``bus.signing_key_path``, default
      ``<run dir>/secrets/bus.key``) created if missing (bus/signing.py);
    - ``proxy_endpoint``: agent mode's proxy port and admin key fixed before the config
      is written, so the proxy and the agent runners read the same ones (port 0 / an
      empty key would otherwise be chosen by the proxy alone); the key goes to a 0600
      file in the run's secrets directory and only its path into the config.
    """
    for dotted, value in (values or {}).items():
        cfg = replace_path(cfg, dotted, value)
    if trial_name is not None or not cfg.trial_name:
        cfg = dataclasses.replace(cfg, trial_name=trial_name or time.strftime("%Y%m%d-%H%M%S"))
    bus = {k: v for k, v in (("bootstrap_servers", bootstrap), ("topic_prefix", topic_prefix),
                             ("client_id", client_id)) if v is not None}
    if bus:
        cfg = dataclasses.replace(cfg, bus=dataclasses.replace(cfg.bus, **bus))
    if prepare:
        cfg = _prepare(cfg)
    if claim_run and not names_a_run(cfg.bus.run_id):
        cfg = replace_path(cfg, "bus.run_id", cfg.run_id)
    if bus_run_id is not None:
        cfg = replace_path(cfg, "bus.run_id", bus_run_id)
    if signing_key:
        from ..bus.signing import create_key_file, key_path_of_run

        if not cfg.bus.signing_key_path:
            cfg = replace_path(cfg, "bus.signing_key_path", str(key_path_of_run(Path(cfg.run_path))))
        create_key_file(cfg.bus.signing_key_path)
    if proxy_endpoint:
        cfg = _fix_proxy_endpoint(cfg)
    return cfg


def _prepare(cfg: C) -> C:
    """The run directory (absolute, created) and the model; the run's own bus run id."""
    if isinstance(cfg, TrainConfig):
        check_datasets(cfg)  # first: it needs neither, and a refused run leaves nothing behind
    cfg = dataclasses.replace(cfg, run_dir=str(Path(cfg.run_dir).resolve()))
    run_dir = Path(cfg.run_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        m = cfg.model
        vision = ({"vision": {"depth": m.vision_depth, "hidden_size": m.vision_hidden_size}}
                  if policy_of_arch(m).vision is not None else {})
        path = create_tiny_checkpoint(
            run_dir / "model", _tiny_task(cfg), arch=m.arch, hidden_size=m.hidden_size,
            num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size, num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
            seed=m.init_seed, tie_word_embeddings=m.tie_word_embeddings, **vision,
            **({"lm_head_init_std": m.lm_head_init_std} if m.lm_head_init_std else {}))
        cfg = replace_path(cfg, "model.path", str(path.resolve()))
    vlm = getattr(cfg, "vlm", None)
    if vlm is not None and not vlm.image_store:  # images beside the run (docs/vlm.md)
        cfg = replace_path(cfg, "vlm.image_store", str(run_dir.resolve() / "images"))
    if isinstance(cfg, TrainConfig):
        # Which features combine (config/features.py), now with the policy of the model
        # directory (vision-language, MoE, its module names): before any role starts.
        check_features(cfg, resolve_policy(cfg))
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and rollout.engine == "torch" and (Path(cfg.model.path) / "config.json").is_file():
        # Fail here, not in a rollout worker's log.
        from ..models.families import check_in_process

        check_in_process(cfg.model.path)
    return replace_path(cfg, "bus.run_id", cfg.run_id)


def check_datasets(cfg: TrainConfig) -> None:
    """Refuse a run whose dataset rows name image files that do not exist, before any role
    starts (ConfigError: exit 78, the row and the path named), where the feeder (the
    train dataset) or the evaluator (the valid dataset) would otherwise stop on the first
    one in its log. tasks/datasets.py :func:`check_image_paths` says which rows it stats."""
    from ..tasks.datasets import check_image_paths

    for section, ds in _read_datasets(cfg):
        check_image_paths(ds, section=section)


def check_dataset_files(cfg: TrainConfig) -> None:
    """Refuse (ConfigError: exit 78, one line naming the section) a run whose dataset file
    is not there: `tapioca train`'s launcher, before anything starts (the feeder would
    otherwise stop on it in its log once every role has started). Not for `tapioca
    train-offline` (it reads the archive, not the dataset) nor for a Ray cluster's run
    (its roles read the data on the cluster's nodes)."""
    from ..tasks.datasets import check_dataset_file

    if cfg.scheduler.type == "ray" and cfg.scheduler.ray_address:
        return
    for section, ds in _read_datasets(cfg):
        check_dataset_file(ds, section=section)


def _read_datasets(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """``(section, DatasetConfig)`` of the datasets the run reads: the train dataset, and
    the valid dataset where the evaluator reads it."""
    out = [("train_dataset", cfg.train_dataset)]
    if cfg.evaluator.enabled and cfg.valid_dataset is not None:
        out.append(("valid_dataset", cfg.valid_dataset))
    return out


def _tiny_task(cfg: Any) -> str:
    """The task whose alphabet the tiny model's tokenizer covers: a supervised config's
    ``tiny_task``; online mode's live text (the printable alphabet of gsm8k); an RL run's
    dataset (synthetic or visual, else gsm8k's)."""
    task = getattr(cfg, "tiny_task", "")
    if task:
        return task
    if getattr(getattr(cfg, "agent", None), "online", False):  # live users type any text
        return "gsm8k"
    kind = cfg.train_dataset.type
    return kind if kind in ("synthetic", "visual") else "gsm8k"


def create_tiny_checkpoint(dir: str | os.PathLike, task: str = "synthetic", *,
                           overwrite: bool = False, **model_kwargs: Any) -> Path:
    """The tiny random model + char tokenizer of ``task``'s alphabet, written to ``dir``
    (:func:`tapioca.models.factory.save_tiny_checkpoint`; an existing checkpoint is kept)."""
    from ..models.factory import save_tiny_checkpoint
    from ..tasks.base import get_task

    return save_tiny_checkpoint(dir, alphabet=get_task(task).alphabet, overwrite=overwrite,
                                **model_kwargs)


def _fix_proxy_endpoint(cfg: C) -> C:
    import secrets
    import socket

    from ..bus.signing import SECRETS_DIR, write_secret_file

    if not cfg.proxy.api_key and not cfg.proxy.api_key_file:
        path = Path(cfg.run_path) / SECRETS_DIR / PROXY_KEY_FILE_NAME
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_secret_file(path, "tapioca-admin-" + secrets.token_hex(16) + "\n")
        cfg = replace_path(cfg, "proxy.api_key_file", str(path))
    if cfg.proxy.port == 0:
        with socket.socket() as s:
            s.bind((cfg.proxy.host, 0))
            cfg = replace_path(cfg, "proxy.port", s.getsockname()[1])
    return cfg


def check_proxy_port(cfg: Any) -> None:
    """Refuse (ConfigError) a run whose agent proxy would listen on a fixed ``proxy.port``
    that another process holds on this host, before any role starts: the proxy would
    otherwise fail to bind it in its own log, after the other roles started. Bound as the
    proxy binds (producers/proxy/server.py: SO_REUSEADDR), then released. Only where the
    local launcher runs the proxy here; port 0 is chosen later (:func:`resolve_run`)."""
    import socket

    if not (cfg.agent.enabled and cfg.proxy.port and cfg.scheduler.type == "local"):
        return
    host, port = cfg.proxy.host, cfg.proxy.port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"proxy.port={port} on {host} is taken ({exc.strerror or exc}): stop what "
                              "listens there or set proxy.port to a free port (0 = any free port)") from None


def run_on_log(cfg: Any, bus_run_id: str) -> bool:
    """Whether the broker holds the log of ``bus_run_id``: its trainer's weights events
    (the weights topic is compacted by run id, so its latest event always stays)."""
    from ..bus.reader import TopicReader
    from ..schemas.events import WeightsEvent

    with TopicReader(cfg.bus, "weights") as reader:
        return any(isinstance(r.event, WeightsEvent) and r.event.run_id == bus_run_id
                   for r in reader.records(idle_s=0.3, timeout_s=60))


def resolve_bus_run_id(cfg: Any) -> str:
    """The run id this run uses on the bus: ``cfg.run_id`` for a new run; for a resumed
    one, the bus run id of its checkpoint if the broker still holds that log, else the
    next one (``demo.t0@2``): the old log is gone, and with it the group numbering."""
    from ..trainers.checkpoint import SUFFIX, read_progress

    progress = read_progress(Path(cfg.run_path) / "checkpoints" / f"trainer{SUFFIX}")
    if progress is None or progress.version == 0:
        return cfg.run_id
    last = progress.bus_run_id or cfg.run_id
    if run_on_log(cfg, last):
        return last
    new = next_bus_run_id(last)
    log.warning("the broker does not hold the log of run id %s (checkpoint at version %d): "
                "resuming as bus run id %s", last, progress.version, new)
    return new
