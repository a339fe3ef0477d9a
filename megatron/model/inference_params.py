"""The key/value cache of incremental decoding (Megatron's `InferenceParams`).

    params = InferenceParams(max_batch_size=b, max_sequence_length=n)
    logits = model(prompt, inference_params=params)        # fills positions 0..s-1
    params.sequence_len_offset += prompt.size(1)
    logits = model(next_token, inference_params=params)    # attends to all cached positions
    params.sequence_len_offset += 1

Each attention layer keeps its keys and values in `key_value_memory_dict[layer_number]`,
two tensors `[max_sequence_length, max_batch_size, heads / tp, kv_channels]` allocated on
first use; a multi-latent attention layer keeps one, its compressed latent with the rotated
shared key `[max_sequence_length, max_batch_size, 1, kv_lora_rank + qk_pos_emb_head_dim]`,
and up-projects the cached positions at every step (as transformers' DeepSeek does). As in
Megatron, the caller advances `sequence_len_offset` after every forward.
"""

from __future__ import annotations

import torch


class InferenceParams:
    """Sizes, the write offset, and the per-layer key/value memory of one generation."""

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"InferenceParams needs max_batch_size >= 1 and max_sequence_length >= 1, got "
                f"{max_batch_size} and {max_sequence_length}"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, ...]] = {}

    def update_key_value(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [s, b, np, hn] keys/values at the offset; return all cached [offset+s, b, ...]."""
        key, value = self.update(layer_number, key, value)
        return key, value

    def update(self, layer_number: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write each [s, b, ...] tensor at the offset; return all cached [offset+s, b, ...]
        (a layer's tensors may differ in width: keys and values, or one latent)."""
        s, b = tensors[0].shape[:2]
        end = self.sequence_len_offset + s
        if end > self.max_sequence_length:
            raise ValueError(
                f"the key/value cache holds {self.max_sequence_length} positions; writing {s} "
                f"at offset {self.sequence_len_offset} needs {end} (raise max_sequence_length)"
            )
        if b > self.max_batch_size:
            raise ValueError(
                f"batch of {b} is larger than the cache's max_batch_size {self.max_batch_size}"
            )
        if layer_number not in self.key_value_memory_dict:
            rows = (self.max_sequence_length, self.max_batch_size)
            self.key_value_memory_dict[layer_number] = tuple(
                torch.empty((*rows, *t.shape[2:]), dtype=t.dtype, device=t.device) for t in tensors
            )
        memories = self.key_value_memory_dict[layer_number]
        for memory, tensor in zip(memories, tensors, strict=True):
            memory[self.sequence_len_offset : end, :b] = tensor
        return tuple(memory[:end, :b] for memory in memories)

    def causal_mask(self, query_length: int, device: torch.device) -> torch.Tensor:
        """Bool [1, 1, s, offset+s], True = masked, for `query_length` new tokens.

        Query i sits at position offset + i and may see keys 0..offset+i: the causal mask
        aligned to the bottom right, unlike SDPA's `is_causal`, which aligns it to the top
        left when there are more keys than queries.
        """
        offset = self.sequence_len_offset
        keys = torch.arange(offset + query_length, device=device)
        queries = torch.arange(offset, offset + query_length, device=device)
        return (keys[None, :] > queries[:, None])[None, None]  # [1, 1, s, offset + s]
