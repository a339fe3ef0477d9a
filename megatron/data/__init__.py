"""Data pipeline: Megatron's mmap indexed dataset, GPT samples, blending and samplers."""
