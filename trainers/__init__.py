"""The RL trainer role and its actor, critic, reference and checkpoints; offline RL from an
archive (`offline.py`); the supervised trainers in `supervised/`."""
