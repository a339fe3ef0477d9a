"""Tests of megatron/training/: the step and loop, optimizer, schedules and monitor."""
