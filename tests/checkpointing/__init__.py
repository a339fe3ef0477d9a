"""Tests of megatron/checkpointing.py and the checkpoint tools."""
