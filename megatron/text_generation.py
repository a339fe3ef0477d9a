"""Text generation with a `GPTModel`: greedy, top-k, top-p and temperature sampling.

    new_tokens = generate(model, [prompt_ids], 32, top_k=40, eod_token_id=tokenizer.eod)

The prompt runs through the model once, filling the key/value cache (`InferenceParams`);
each further step feeds only the token just sampled (`use_cache=False` reruns the whole
sequence instead, for checking). The filtering follows Megatron's
`modify_logits_for_top_k_filtering` / `modify_logits_for_top_p_filtering`.

Every tensor-parallel rank makes the same calls. Logits are gathered over the vocabulary,
every rank samples with a generator seeded alike, and the sampled tokens are broadcast from
the first rank of the tensor-parallel group, so all ranks continue with the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.core.tensor_parallel.mappings import (
    broadcast_from_tensor_parallel_src,
    gather_from_tensor_model_parallel_region,
)
from megatron.model import GPTModel
from megatron.model.inference_params import InferenceParams


def check_sampling_args(top_k: int, top_p: float, temperature: float) -> None:
    """Raise ValueError, naming the flag, for settings Megatron's sampler rejects."""
    if top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"--top_p must be in [0, 1] (0 disables it), got {top_p}")
    if top_k > 0 and top_p > 0.0:
        raise ValueError(f"--top_k ({top_k}) and --top_p ({top_p}) cannot both be set")
    if not temperature > 0.0:
        raise ValueError(f"--temperature must be > 0, got {temperature}")


def modify_logits_for_top_k_filtering(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set all but the `top_k` largest logits of each row of [b, v] to -inf (in place)."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    kept.scatter_(-1, torch.topk(logits, top_k, dim=-1).indices, True)
    return logits.masked_fill_(~kept, float("-inf"))


def modify_logits_for_top_p_filtering(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row of [b, v], the most likely tokens whose mass first reaches `top_p`."""
    sorted_logits, sorted_indices = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [b, v]
    # Drop a token when the more likely ones before it already hold top_p of the mass.
    dropped = torch.zeros_like(cumulative, dtype=torch.bool)
    dropped[:, 1:] = cumulative[:, :-1] >= top_p
    dropped = dropped.scatter(-1, sorted_indices, dropped)  # back to vocabulary order
    return logits.masked_fill_(dropped, float("-inf"))


def sample_logits(
    logits: torch.Tensor,
    *,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Next-token ids [b] from logits [b, v] over the whole (padded) vocabulary.

    `greedy` (or `top_k=1`) takes the argmax; otherwise logits are divided by `temperature`,
    filtered by `top_k` or `top_p` (0 disables either), and sampled with `generator`.
    Ids >= `vocab_size` (the padding rows of the embedding) are never chosen.
    """
    check_sampling_args(top_k, top_p, temperature)
    padded = logits.size(-1)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {padded}] (the logits' width)")
    if top_k > vocab_size:
        raise ValueError(f"--top_k ({top_k}) is larger than the vocabulary ({vocab_size})")
    logits = logits[:, :vocab_size].float().clone()  # [b, vocab_size]: no padding ids
    if greedy or top_k == 1:
        return logits.argmax(dim=-1)
    logits.div_(temperature)
    if top_k > 0:
        modify_logits_for_top_k_filtering(logits, top_k)
    elif top_p > 0.0:
        modify_logits_for_top_p_filtering(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _as_batch(prompt_token_ids: list[list[int]] | list[int], vocab_size: int) -> list[list[int]]:
    """Equal-length prompts with ids in range, as a list of lists."""
    if len(prompt_token_ids) and not isinstance(prompt_token_ids[0], (list, tuple)):
        prompt_token_ids = [prompt_token_ids]  # one prompt of ids
    prompts = [[int(t) for t in prompt] for prompt in prompt_token_ids]
    if not prompts or not all(prompts):
        raise ValueError("every prompt needs at least one token")
    if len({len(prompt) for prompt in prompts}) != 1:
        raise ValueError(
            f"prompts of a batch must have equal lengths, got {[len(p) for p in prompts]}"
        )
    bad = [t for prompt in prompts for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return prompts


def _next_logits(
    model: GPTModel, tokens: torch.Tensor, cache: InferenceParams | None
) -> torch.Tensor:
    """Full-vocabulary logits [b, v] after the last of `tokens` [b, s] (advancing the cache)."""
    if cache is None:
        logits = model(tokens)  # [b, s, v(/tp)]
    else:
        offset = cache.sequence_len_offset
        positions = torch.arange(offset, offset + tokens.size(1), device=tokens.device)[None]
        logits = model(tokens, position_ids=positions, inference_params=cache)
        cache.sequence_len_offset += tokens.size(1)
    logits = logits[:, -1]  # [b, v(/tp)]
    if model.config.parallel_output:
        logits = gather_from_tensor_model_parallel_region(logits)  # [b, v]
    return logits


def _generate_tokens(
    model: GPTModel,
    tokens: torch.Tensor,
    max_new_tokens: int,
    sample: Callable[[torch.Tensor], torch.Tensor],
    eod_token_id: int | None,
    use_cache: bool,
) -> torch.Tensor:
    """[b, s] prompt -> [b, n <= max_new_tokens] new tokens (eod repeated after a stop)."""
    batch, prompt_length = tokens.shape
    cache = InferenceParams(batch, prompt_length + max_new_tokens) if use_cache else None
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    new_tokens: list[torch.Tensor] = []
    step_input = tokens
    for _ in range(max_new_tokens):
        next_tokens = broadcast_from_tensor_parallel_src(
            sample(_next_logits(model, step_input, cache))
        )
        if eod_token_id is not None:
            next_tokens = next_tokens.masked_fill(done, eod_token_id)  # [b]
            done |= next_tokens == eod_token_id
        new_tokens.append(next_tokens)
        tokens = torch.cat((tokens, next_tokens[:, None]), dim=1)  # [b, s + 1]
        step_input = next_tokens[:, None] if use_cache else tokens
        if eod_token_id is not None and bool(done.all()):
            break
    return torch.stack(new_tokens, dim=1) if new_tokens else tokens[:, :0]


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt_token_ids: list[list[int]] | list[int],
    max_new_tokens: int,
    *,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    eod_token_id: int | None = None,
    seed: int = 1234,
    use_cache: bool = True,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """The tokens generated after each prompt (one list per prompt, eod included if drawn).

    Prompts of a batch must have equal lengths; a flat list is one prompt. A sequence stops
    at `eod_token_id`, and generation stops at `--max-position-embeddings` positions.
    `vocab_size`: the tokenizer's vocabulary (ids above it are embedding padding; default
    the model's full vocabulary). The model runs in eval mode and is put back afterwards.
    """
    check_sampling_args(top_k, top_p, temperature)
    if max_new_tokens < 0:
        raise ValueError(f"--out-seq-length must be >= 0, got {max_new_tokens}")
    vocab_size = model.config.vocab_size if vocab_size is None else vocab_size
    prompts = _as_batch(prompt_token_ids, vocab_size)
    max_positions = model.config.max_position_embeddings
    if len(prompts[0]) > max_positions:
        raise ValueError(
            f"prompt of {len(prompts[0])} tokens is longer than --max-position-embeddings "
            f"{max_positions}"
        )
    max_new_tokens = min(max_new_tokens, max_positions - len(prompts[0]))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        return sample_logits(
            logits,
            greedy=greedy,
            top_k=top_k,
            top_p=top_p,
            temperature=temperature,
            generator=generator,
            vocab_size=vocab_size,
        )

    was_training = model.training
    model.eval()
    try:
        tokens = torch.tensor(prompts, dtype=torch.long, device=device)  # [b, s]
        new = _generate_tokens(model, tokens, max_new_tokens, sample, eod_token_id, use_cache)
    finally:
        model.train(was_training)
    return [_cut_at_eod(row, eod_token_id) for row in new.tolist()]


def _cut_at_eod(tokens: list[int], eod_token_id: int | None) -> list[int]:
    """`tokens` up to and including the first eod."""
    if eod_token_id is None or eod_token_id not in tokens:
        return tokens
    return tokens[: tokens.index(eod_token_id) + 1]
