"""Tests of megatron/arguments/: the parser, the flag checks and the DeepSpeed config."""
