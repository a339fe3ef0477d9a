"""Megatron-style GPT-2 pretraining with DeepSpeed.

Importing this package has no side effects; the subpackages are imported explicitly.
"""

__version__ = "0.1.0"
