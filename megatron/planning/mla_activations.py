"""What a multi-latent attention layer keeps for backward (`--multi-latent-attention`,
megatron/model/multi_latent_attention.py), in place of standard attention's query/key/value,
rotations, core and output-projection input; the input norm and its output are counted as
for every layer (`activations.layer_bytes`).

Per micro-batch on one tensor-parallel rank, T tokens (R = T / tp under sequence
parallelism), n = heads / tp, c the compute dtype, widths Q = n (qk + pos) (queries and keys),
V = n v (values), KV = n (qk + v) (the key/value up-projection's output), r_q and r the query
and key/value latents, pos the rotary channels:

- the query latent: its norm (fp32 input, rstd, normalized rows in c) and the up-projection's
  input R r_q c (without `--qk-layernorm` the down-projection's output); none without a query
  latent (the query projection reads the input norm's output);
- the key/value latent: the down-projection's output [T, r + pos] (whose view the latent
  norm reads in fp32 when c is fp32; else an fp32 copy), rstd, the normalized rows and the
  up-projection's input R r c;
- the rotations' cos and sin [s, 1, 1, pos] in c (the query's and the shared key's);
- the core: a fused kernel keeps the queries and keys (T Q c), the values (views of the
  up-projection's output: T KV c), its output (the output projection's input, T V c) and the
  log-sum-exp; CPUs run MLA's unequal widths in torch's math kernel, which keeps fp32 copies of
  the scaled queries and the keys (and of the values when c is half; the views otherwise) and
  the probabilities (three tensors of them with attention dropout);
- `--recompute-modules core_attn`: the core's inputs only (queries, keys, value views);
  `mla_up_proj`: the up-projections run without a graph, their inputs kept (the latents, the
  shared rotary key's view of the down-projection output, the angles), their outputs freed
  until the backward (a fused core then keeps nothing of them; the math kernel's copies stay).
"""

from __future__ import annotations

from megatron.config import ModelConfig
from megatron.model.utils import recomputes
from megatron.planning.dtypes import Dtypes
from megatron.planning.inputs import PlanInputs

_FP32 = 4


def _latent_norm_bytes(rows: int, width: int, size: Dtypes, fp32_input: int) -> int:
    """An RMSNorm over a latent (its input a matmul output in the compute dtype): the fp32
    rows it computes on (`fp32_input` bytes: the input's own storage when that is fp32, else
    a copy), rstd, and the normalized rows in the compute dtype."""
    return fp32_input + rows * _FP32 + rows * width * size.compute


def _matmul_rows(inputs: PlanInputs) -> int:
    """Rows of the input norm's output a projection keeps: this rank's part under sequence
    parallelism, else every token."""
    tokens = inputs.local_seq_length * inputs.micro_batch
    return tokens // inputs.tp if inputs.model.sequence_parallel else tokens


def mla_attention_bytes(inputs: PlanInputs, size: Dtypes, math: bool) -> int:
    """What one MLA layer's attention keeps but for the input norm and its output (module
    docstring); `math`: the core is torch's math kernel (CPU)."""
    config, tp = inputs.model, inputs.tp
    mla, c = config.mla, size.compute
    b, s = inputs.micro_batch, inputs.local_seq_length
    tokens = s * b
    rows = tokens // tp if config.sequence_parallel else tokens
    heads = config.num_attention_heads // tp
    q_width = heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
    v_width, kv_width = heads * mla.v_head_dim, heads * (mla.qk_head_dim + mla.v_head_dim)
    up_recomputed = recomputes(config, "mla_up_proj")
    combined = tokens * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) * c  # kv down output
    # Two projections read the input norm's output: under autocast each casts its own copy
    # (the one the layer counts, and this one).
    total = _matmul_rows(inputs) * config.hidden_size * c if c < size.residual else 0
    # The up-projections' inputs: a norm's output (the parameters' dtype) the recomputed
    # function keeps, else the matmul's copy in the compute dtype.
    up_input = size.residual if up_recomputed and config.qk_layernorm else c
    if mla.q_lora_rank is not None:
        latent = rows * mla.q_lora_rank
        if config.qk_layernorm:
            total += _latent_norm_bytes(rows, mla.q_lora_rank, size, latent * _FP32)
        total += latent * up_input
    # The key/value latent: its own storage under sequence parallelism (the scatter's copy).
    own = config.sequence_parallel
    latent = rows * mla.kv_lora_rank
    if config.qk_layernorm:
        fp32_input = combined if c == _FP32 and not own else latent * _FP32
        total += _latent_norm_bytes(rows, mla.kv_lora_rank, size, fp32_input)
        total += latent * up_input
    else:
        total += latent * c if own else combined
    if up_recomputed:
        # The shared rotary key, a view of the down-projection's output, and the fp32 angles;
        # without a query latent the projected queries, the function's input too.
        total += combined + s * mla.qk_pos_emb_head_dim * _FP32
        if mla.q_lora_rank is None:
            total += tokens * q_width * c
        if config.qk_layernorm and c == _FP32 and not own:
            total -= combined  # already kept as the latent norm's input
    else:
        total += 4 * s * mla.qk_pos_emb_head_dim * c  # the two rotations' cos and sin
    total += tokens * v_width * c  # the core's output, the output projection's input
    # The core's inputs: freed until the backward when the up-projections are recomputed.
    inputs_kept = 0 if up_recomputed else tokens * (2 * q_width + kv_width) * c
    if recomputes(config, "core_attn"):
        return total + inputs_kept
    if math:
        probabilities = b * heads * s * s * _FP32
        kept = 3 if config.attention_dropout > 0.0 else 1
        values = tokens * v_width * _FP32 if c < _FP32 else tokens * kv_width * c
        if up_recomputed and c == _FP32:
            values = 0  # views of the freed values
        return total + 2 * tokens * q_width * _FP32 + values + kept * probabilities
    return total + inputs_kept + b * heads * s * _FP32  # a fused kernel's log-sum-exp


def mla_weight_elements(config: ModelConfig) -> int:
    """A multi-latent attention layer's matmul weights that torch.autocast casts and autograd
    keeps, all ranks together (each is column- or row-parallel: a rank holds 1 / tp): all of
    them, but the up-projections' when `mla_up_proj` recomputes them (cast without a graph)."""
    mla, h, heads = config.mla, config.hidden_size, config.num_attention_heads
    q_width = heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
    total = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) + heads * mla.v_head_dim * h
    if mla.q_lora_rank is None:
        total += h * q_width
    else:
        total += h * mla.q_lora_rank
    if recomputes(config, "mla_up_proj"):
        return total
    total += mla.kv_lora_rank * heads * (mla.qk_head_dim + mla.v_head_dim)
    return total + (mla.q_lora_rank or 0) * q_width
