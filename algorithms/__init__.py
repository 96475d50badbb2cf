"""Pure RL math shared by the advantage processor and the trainer.

Consumes plain numbers and tensors, emits plain numbers and tensors; no Kafka, no
config classes, no I/O. Roles import these functions; they never import each other.

Modules (docs/algorithms.md has the formulas, switches and conventions):
  advantages          group advantage estimators and AReaL's normalisation levels (no
                      torch: the advantage processor is a light consumer)
  reward_shaping      weighted reward sources, DAPO's overlong penalty (no torch)
  gae                 GAE (token / turn level), discounted returns, clipped value loss,
                      masked batch normalisation (torch)
  kl                  per-token KL estimators k1/k2/k3 (torch)
  policy_losses       one pipeline for PPO, GSPO, SAPO, CISPO surrogates + entropy bonus
  rejection_sampling  behaviour weight, its cap, rejection sampling (IcePop, KPop), M2PO
  prox_logp           proximal logprobs: loglinear approximation
  stale_tokens        stale-token masking: the loss masks of actor.max_token_version_gap
  aggregation         token/sequence loss aggregation modes (torch)
  preference          DPO (sigmoid, IPO) and Bradley-Terry losses
  supervised          masked NLL, chunked forward KL for distillation
  logprobs            memory-bounded per-token logprobs and entropy (torch)

This package deliberately re-exports nothing: importing ``tapioca.algorithms``
must not import torch, so ``tapioca.algorithms.advantages`` stays torch-free.
"""
