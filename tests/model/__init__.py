"""Tests of the GPT-2 model: layout, numerics, tensor/sequence parallelism and the pipeline."""
