"""Steep's algorithm core: configs, losses, advantages, staleness, trainer, inference.

Pure Python + torch. Never imports Django. Importing this package (or
``rl_core.config``) must not import torch, so the web process can share the
config dataclass without pulling in the training stack.
"""
