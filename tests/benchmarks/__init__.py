"""Tests of benchmarks/ helpers that other code relies on (the measured-run meters)."""
