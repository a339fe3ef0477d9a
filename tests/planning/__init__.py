"""Tests of megatron/planning and the --dry-run entry (megatron/dry_run.py)."""
