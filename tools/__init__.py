"""Command-line tools: preprocess, merge, check, build corpora. They import megatron, not back."""
