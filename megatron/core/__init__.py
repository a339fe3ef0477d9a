"""Model-parallel building blocks: process groups and tensor-parallel layers."""
