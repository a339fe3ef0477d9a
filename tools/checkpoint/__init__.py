"""Checkpoint conversion tools: reshard, and to/from Hugging Face GPT-2."""
