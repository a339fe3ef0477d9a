"""Tests of megatron/checkpointing/: save and load, the commit protocol, shards and tools."""
