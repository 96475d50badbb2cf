"""Everything about moving and following policy weights, between the trainer and the engines.

Consumes state dicts (the trainer) and ``WeightsEvent`` s (every follower); emits the
transport fields of ``WeightsEvent`` s and verified tensors. Keyed by version. A layer
between the roles (``producers/``, ``trainers/``, which import it) and ``schemas/``,
``bus/``, ``models/`` (which it may import); it never imports a role.

- Files and checksums (:mod:`.files`): safetensors files written atomically with their
  sha256, verified reads, the weight-transfer errors; a LoRA version's adapter
  directory (:mod:`.adapter_files`); either payload by path or version (:mod:`.payload`).
- One interface, three transports (``weights.transport``; docs/weight-sync.md):
  :class:`WeightPublisher` (the trainer: ``publish(state_dict, version)`` returns the
  transport fields of the version's ``WeightsEvent``; ``poll()`` returns the durable
  files its background writer finished; ``close()``) and :class:`WeightReceiver` (a
  rollout worker, the agent proxy: ``fetch(event)`` returns verified tensors for
  ``InferenceEngine.update_weights``). ``file`` writes a safetensors file per version
  (sha256); ``ipc`` shares a flat buffer on one host (CUDA IPC, or /dev/shm on CPU;
  :mod:`.layout`, :mod:`.slots`); ``nccl`` lets workers pull versions over a process
  group (nccl, or gloo on CPU; :mod:`.nccl`); :mod:`.durable` writes the fast
  transports' files in the background. Fast transports carry per-bucket checksums that
  the reader checks.
- The loaders the roles call: :func:`make_weight_loader` (an in-process engine, over
  the event's transport) and :func:`make_server_weight_loader` (a vLLM / SGLang server,
  from the verified file).
- Following ``weights.v1``: the version rule (:mod:`.versions`: versions only go
  forward) and the follow rule every member that loads weights applies (:mod:`.follow`).
"""

from .publisher import WeightPublisher
from .receiver import WeightReceiver, make_server_weight_loader, make_weight_loader

__all__ = ["WeightPublisher", "WeightReceiver", "make_server_weight_loader", "make_weight_loader"]
