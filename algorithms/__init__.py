"""Pure RL math shared by the advantage processor and the trainer.

Consumes plain numbers and tensors, emits plain numbers and tensors; no Kafka, no
config classes, no I/O. Roles import these functions; they never import each other.

Modules:
  advantages   reward shaping and group advantage estimators (no torch: the
               advantage processor is a light consumer)
  kl           per-token KL estimators k1/k2/k3 (torch)
  aggregation  token/sequence loss aggregation modes (torch)
  ppo_loss     AReaL's decoupled PPO actor loss (torch)
  logprobs     memory-bounded per-token logprobs and entropy (torch)

This package deliberately re-exports nothing: importing ``tapioca.algorithms``
must not import torch, so ``tapioca.algorithms.advantages`` stays torch-free.
"""
