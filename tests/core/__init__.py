"""Tests of megatron.core: process groups, tensor-parallel layers, loss and RNG handling."""
