"""Weight transports: how a new policy version gets from the trainer into the engines.

One interface, three transports (``actor.weight_transport``; docs/weight-sync.md):

- :class:`WeightPublisher` (the trainer): ``publish(state_dict, version)`` returns the
  transport fields of the version's ``WeightsEvent``; ``poll()`` returns the durable
  files its background writer finished; ``close()``.
- :class:`WeightReceiver` (a rollout worker, the agent proxy): ``fetch(event)`` returns
  verified tensors for ``InferenceEngine.update_weights``;
  :func:`make_weight_loader` wraps both into the roles' ``load_weights`` callable.

``file`` writes a safetensors file per version (sha256); ``ipc`` shares a flat buffer
on one host (CUDA IPC, or /dev/shm on CPU); ``nccl`` lets workers pull versions over a
process group (nccl, or gloo on CPU). The weights event names the transport and what a
reader needs; fast transports carry per-bucket checksums that the reader checks.
"""

from .publisher import WeightPublisher
from .receiver import WeightReceiver, make_weight_loader

__all__ = ["WeightPublisher", "WeightReceiver", "make_weight_loader"]
