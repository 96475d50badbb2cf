"""The supervised trainers: SFT, DPO, the Bradley-Terry reward model and distillation
(`tapioca sft|dpo|rm|distill`), one process each, on the RL trainer's backbone.

``loop.py`` is their shared loop (data order, steps, checkpoints, weights files and
events, metrics, ``final/``), ``data.py`` their examples (files, the synthetic task, or a
run's logs). Offline RL from an archive (`tapioca train-offline`) is not here: it is the
RL trainer role fed from a Parquet log (``trainers/offline.py``).
"""
