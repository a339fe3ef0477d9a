"""Activation memory: what autograd keeps per layer and micro-batch, and the logits' working set.

Counted from what our layers save for backward (checked against
`torch.autograd.graph.saved_tensors_hooks` in tests/planning/test_activations.py), per
micro-batch of b sequences of s tokens on one tensor-parallel rank, with T = s x b tokens
(s / S of each sequence under DeepSpeed-Ulysses, s / C under context parallelism),
T' = T / tp in the sequence-parallel regions (norms, dropout, residual) under
`--sequence-parallel`, else T:

- each norm's input (T' x h, residual dtype) and statistics; its output as the next
  matmul's input (T' x h, compute dtype; sequence parallelism gathers it again in the
  backward, as Megatron does; an FP8 layer keeps the gathered T x h,
  `fp8.keeps_gathered_input`);
- query/key/value (T x (np + 2 nkv) hn / tp), the attention output (T x np hn / tp), and
  the softmax statistics; with the unfused kernel, or torch's math kernel (which CPU
  attention with dropout falls back to), the b x np/tp x s x s probabilities, their dropout
  mask and the dropped probabilities;
- under context parallelism, by `--cp-comm-type`: ring attention (`p2p`) keeps its output
  and an fp32 log-sum-exp like a flash kernel (no scores, also with dropout); `allgather`
  the gathered keys and values [b, g, s, hn] and a bool mask [s/C, s]; `a2a` what Ulysses
  keeps;
- the MLP's first output (T x ffn / tp, or 2 ffn with SwiGLU) and activation output;
- a dropout mask (T' x h; bool on GPUs) after attention, after the MLP and after the
  embedding;
- in a Megatron-LM routed MoE layer, the router, the dispatch, the experts' rows, the
  combine and the shared expert in place of the MLP's (`routed_moe.routed_mlp_bytes`).

Megatron's accounting (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 2:
s b h (34 + 5 a s / h) bytes per layer in fp16) counts the same tensors; ours differ where
our kernels do (fused attention keeps no s x s tensor; the plain path's residual stream
is fp32 under autocast).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.config import ModelConfig
from megatron.core.tensor_parallel.cross_entropy import CHUNK_BYTES, CPU_CHUNK_BYTES
from megatron.model.model_size import runs_in_fp8
from megatron.model.transformer import recompute_chunks
from megatron.model.utils import recomputes
from megatron.planning.dtypes import Dtypes, dtypes
from megatron.planning.fp8 import keeps_gathered_input
from megatron.planning.inputs import PlanInputs
from megatron.planning.mla_activations import mla_attention_bytes, mla_weight_elements
from megatron.planning.mtp_activations import mtp_module_bytes, mtp_weight_elements
from megatron.planning.routed_moe import (
    is_routed_layer,
    routed_mlp_bytes,
    routed_output_mask_bytes,
    routed_weight_copy_elements,
)

_FP32 = 4


def _math_attention(
    inputs: PlanInputs, comm_type: str | None = None, layer_number: int | None = None
) -> bool:
    """Whether attention materializes s x s probabilities (no fused kernel covers it)."""
    config = inputs.model
    if comm_type == "p2p":
        return False  # ring attention's blocks keep only their log-sum-exp (any dropout)
    if config.attention_backend == "unfused":
        return True
    if comm_type is None and config.layer_window(layer_number or 1) is not None:
        # A sliding window on CPUs: each sample's SDPA call takes its band mask, which sends
        # it to the math kernel (`document_mask.varlen_attention`).
        return inputs.device_type == "cpu"
    # On CPUs torch's fused SDPA kernel has no dropout: with attention dropout it runs the
    # math kernel. On GPUs flash / memory-efficient attention handle dropout themselves.
    return inputs.device_type == "cpu" and config.attention_dropout > 0.0


def _math_attention_bytes(
    inputs: PlanInputs, b: int, heads: int, queries: int, keys: int, keys_width: int = 0
) -> int:
    """What the math attention kernel keeps for `queries` x `keys` scores per head: on CPUs
    it computes in fp32 (half inputs are upcast), keeping the scaled query and key (and the
    value when upcast) and the probabilities, their dropout mask and the dropped
    probabilities. `keys_width`: the keys and values are not this rank's own (CP
    `allgather`): fp32 copies of all `keys` of that width, the query's of this rank's."""
    probabilities = b * heads * queries * keys * _FP32
    kept = 3 if inputs.model.attention_dropout > 0.0 else 1
    width = inputs.model.projection_size // inputs.tp
    tokens = inputs.local_seq_length * b
    if keys_width:
        return kept * probabilities + (tokens * width + 2 * b * keys * keys_width) * _FP32
    # The scaled query and the key; the value too where it is upcast or expanded per head.
    grouped = inputs.model.num_key_value_heads < inputs.model.num_attention_heads
    copies = 2 if dtypes(inputs).compute == _FP32 and not grouped else 3
    return kept * probabilities + copies * tokens * width * _FP32


def _comm_type(inputs: PlanInputs, layer_number: int | None) -> str | None:
    """The layer's context-parallel attention (`p2p`, `allgather`, `a2a`), None without CP."""
    if inputs.cp == 1:
        return None
    return inputs.cp_comm_type(layer_number or 1)


def _attention_core_bytes(inputs: PlanInputs, comm_type: str | None, math: bool) -> int:
    """What the attention core keeps besides query/key/value and the context the output
    projection saves, per micro-batch on one rank.

    - whole sequence, or Ulysses / CP `a2a` (whole sequences of np / S heads): softmax
      statistics, or the math kernel's probabilities; Ulysses and a2a keep the core's output
      before its all-to-all back to the sequence split;
    - CP `p2p` (ring attention): its fp32-merged output in the compute dtype and the fp32
      log-sum-exp [b, np, s/C], like a flash kernel; no scores;
    - CP `allgather`: the gathered keys and values [b, g, s, hn], the mask [s/C, s] the
      core attends with (SDPA makes it additive, in the compute dtype) and the log-sum-exp;
      with the math kernel its fp32 copies and probabilities instead. (Grouped-query
      attention over gathered keys takes another CPU kernel: measured 7-14% less than this.)
    """
    config, tp = inputs.model, inputs.tp
    size = dtypes(inputs)
    b, s, local = inputs.micro_batch, inputs.seq_length, inputs.local_seq_length
    heads = config.num_attention_heads // tp
    output = local * b * (config.projection_size // tp) * size.compute
    grouped = config.num_key_value_heads < config.num_attention_heads
    # With fewer key/value heads the query is a reshaped copy of the fused projection's slice
    # (with rotary positions the rotated copy is kept instead: `rotary_bytes`).
    query = output if grouped and not config.rotary else 0
    if comm_type == "p2p":
        return query + output + b * heads * local * _FP32
    if comm_type == "allgather":
        width = config.projection_size // tp
        if math:  # fp32 copies of the query and of the whole keys and values, per query head
            return _math_attention_bytes(inputs, b, heads, local, s, keys_width=width)
        gathered = 2 * b * s * config.kv_projection_size // tp * size.compute
        mask = local * s * size.compute  # the bool mask as SDPA's additive one
        # SDPA's output is laid out so that the output projection's input is a view of it.
        return gathered + mask + query + b * heads * local * _FP32
    split = inputs.split  # Ulysses or a2a: the whole sequence, 1/S of the heads
    total = output if split > 1 else 0
    if math:
        return total + _math_attention_bytes(inputs, b, heads // split, s, s)
    return total + b * heads // split * s * _FP32  # softmax statistics


def sink_math(inputs: PlanInputs) -> bool:
    """Whether attention with sinks runs the explicit math (`attention.sink_kernel_for`)."""
    config = inputs.model
    return config.attention_backend == "unfused" or config.attention_dropout > 0.0


def sink_attention_bytes(inputs: PlanInputs, layer_number: int | None = None) -> int:
    """What attention with sinks (`megatron/model/attention_sinks.py`) keeps besides query,
    key, value and the output projection's input, per micro-batch on one rank.

    The explicit math (attention dropout, the `unfused` backend): the fp32 probabilities with
    the sink column, the bool mask, with grouped-query attention the keys and values copied
    per query head, and the probabilities the value product reads (dropped, or cast to a half
    compute dtype) with their dropout mask. The fused kernels: the log-sum-exp and the
    sigmoid(lse - sink) weight, both fp32 [b, np, s] (the rescaled output the CPU flash
    kernel's backward reads is the output projection's input).
    """
    config, tp = inputs.model, inputs.tp
    size = dtypes(inputs)
    b, s = inputs.micro_batch, inputs.local_seq_length
    heads = config.num_attention_heads // tp
    output = s * b * (config.projection_size // tp) * size.compute
    if not sink_math(inputs):
        kept = 2 * b * heads * s * _FP32
        if inputs.device_type == "cpu" and config.layer_window(layer_number or 1) is not None:
            # One call per sample (`varlen_attention`): each keeps its own output and its
            # window's additive mask [s, s].
            kept += output + b * s * s * size.compute
        return kept
    scores = b * heads * s * s
    total = b * heads * s * (s + 1) * _FP32 + s * s  # probabilities and the bool mask
    # The products' contiguous copies of the query and of the keys and values (per query
    # head with grouped-query attention).
    grouped = config.num_key_value_heads < config.num_attention_heads
    total += output + 2 * (
        output if grouped else s * b * config.kv_projection_size // tp * size.compute
    )
    if config.attention_dropout > 0.0:  # the mask: bool on GPUs, the probabilities' dtype on CPUs
        mask = 1 if inputs.device_type == "cuda" else size.compute
        total += scores * (mask + size.compute)
    elif size.compute < _FP32:
        total += scores * size.compute
    return total


def layer_bytes(inputs: PlanInputs, kept: bool = True, layer_number: int | None = None) -> int:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank.

    `kept=False`: under full recomputation, what a recomputed layer keeps (nothing but a
    group's input, counted by `stage_activation_bytes`). `layer_number` (1-based) picks the
    layer's context-parallel attention (`--cp-comm-type` per layer); None: the first's.
    """
    if not kept:
        return 0
    config, tp = inputs.model, inputs.tp
    size = dtypes(inputs)
    b = inputs.micro_batch
    tokens = inputs.local_seq_length * b  # s / C (or / S) tokens under a sequence split
    region = tokens // tp if config.sequence_parallel else tokens
    h = config.hidden_size
    qkv = (config.projection_size + 2 * config.kv_projection_size) // tp
    norm = norm_bytes(config, size, region, h)
    if recomputes(config, "layernorm"):  # run without a graph: only its input is kept
        norm = region * h * size.residual
    # Two norms, and the first's output as the next matmul's input: under sequence
    # parallelism only this rank's part, gathered again in the backward (the second's with
    # the MLP, `_mlp_bytes`), unless FP8 keeps the gathered input.
    total = 2 * norm
    if not _norm_output_freed(inputs):
        total += _matmul_input_tokens(inputs, layer_number) * h * size.compute
    selective = config.recompute_granularity == "selective"
    comm_type = _comm_type(inputs, layer_number)
    math = _math_attention(inputs, comm_type, layer_number) and not selective
    # (The upcasting math kernel keeps fp32 copies; over gathered keys and values, also of
    # the value.)
    if config.mla is not None:  # its widths differ: the math kernel on CPUs
        math = inputs.device_type == "cpu" or config.attention_dropout > 0.0
        total += mla_attention_bytes(inputs, size, math)
    elif config.softmax_type != "vanilla":  # attention sinks (whole sequences only)
        math = sink_math(inputs) and not selective
        if not math:  # (the math keeps its own copies of them: `sink_attention_bytes`)
            total += tokens * qkv * size.compute  # query, key, value
        total += rotary_bytes(inputs, math)
        total += tokens * (config.projection_size // tp) * size.compute  # the output's input
        total += sink_attention_bytes(inputs, layer_number) if not selective else 0
    else:
        # (The math kernel's copies replace them where it upcasts, expands grouped keys
        # and values per query head, or attends over gathered ones.)
        grouped = config.num_key_value_heads < config.num_attention_heads
        if not (math and (size.compute < _FP32 or comm_type == "allgather" or grouped)):
            total += tokens * qkv * size.compute  # query, key, value
        total += rotary_bytes(inputs, math)
        total += tokens * (config.projection_size // tp) * size.compute  # the output's input
        total += _attention_core_bytes(inputs, comm_type, math)
    total += _mlp_bytes(inputs, layer_number)
    if config.hidden_dropout > 0.0:  # masks after attention and after the MLP
        mlp_mask = size.branch_mask
        if is_routed_layer(config, layer_number):
            mlp_mask = routed_output_mask_bytes(inputs, size)
        total += region * h * (size.branch_mask + mlp_mask)
    return total


def norm_bytes(config: ModelConfig, size: Dtypes, rows: int, width: int) -> int:
    """What one norm over `rows` x `width` keeps: LayerNorm its input, mean and rstd; RMSNorm
    (computed in fp32) its fp32 input (a copy when the residual is half), rstd, and the
    normalized rows in the residual dtype (the weight's gradient reads them)."""
    if config.normalization == "rmsnorm":
        return rows * width * (_FP32 + size.residual) + rows * _FP32
    return rows * width * size.residual + 2 * rows * _FP32


def rotary_bytes(inputs: PlanInputs, math: bool = False) -> int:
    """What rotary positions add to a standard attention layer: the rotated queries and keys
    (new tensors a fused core keeps in place of the projection's views; the math kernel keeps
    its own scaled copies instead) and each rotation's cos and sin [s, 1, 1, rotated
    channels] in the compute dtype (two rotations)."""
    config = inputs.model
    if not config.rotary or config.mla is not None:
        return 0
    size = dtypes(inputs).compute
    tokens = inputs.local_seq_length * inputs.micro_batch
    rotated = int(config.kv_channels * config.rotary_percent)
    copies = tokens * (config.projection_size + config.kv_projection_size) // inputs.tp
    copies = 0 if math else copies
    return (copies + 4 * inputs.local_seq_length * rotated) * size


def _norm_output_freed(inputs: PlanInputs) -> bool:
    """Whether `--recompute-modules layernorm` frees a norm's output the next matmul keeps:
    yes where the matmul keeps the output itself, not autocast's half copy of it."""
    size = dtypes(inputs)
    return recomputes(inputs.model, "layernorm") and size.compute == size.residual


def _mlp_bytes(inputs: PlanInputs, layer_number: int | None) -> int:
    """What a layer's MLP keeps, its input (the second norm's output) included: the dense
    MLP's, or a routed MoE layer's (`routed_moe.routed_mlp_bytes`); recomputed
    (`--recompute-modules mlp` / `moe`), its input alone (nothing once the norm's output is
    freed too)."""
    config, tp = inputs.model, inputs.tp
    size = dtypes(inputs)
    routed = is_routed_layer(config, layer_number)
    if recomputes(config, "moe" if routed else "mlp"):
        rows = inputs.local_seq_length * inputs.micro_batch
        rows = rows // tp if config.sequence_parallel else rows
        freed = recomputes(config, "layernorm")  # the checkpoint's input is the norm's output
        return 0 if freed else rows * config.hidden_size * size.residual
    if routed:
        return routed_mlp_bytes(inputs, size)
    tokens = inputs.local_seq_length * inputs.micro_batch
    ffn = config.ffn_hidden_size // tp
    mlp_in = 2 * ffn if config.gated else ffn
    total = 0
    if not _norm_output_freed(inputs):
        total += _matmul_input_tokens(inputs, layer_number) * config.hidden_size * size.compute
    total += tokens * mlp_in * size.activation_input + tokens * ffn * size.compute
    if config.activation == "swiglu" and not config.glu_keeps_input_only:
        total += tokens * ffn * size.activation_input  # silu(gate), kept for the product
    return total


def _matmul_input_tokens(inputs: PlanInputs, layer_number: int | None) -> int:
    """Tokens of a column-parallel layer's input kept for the backward: this rank's part
    under sequence parallelism, the whole gathered sequence where FP8 keeps it
    (`fp8.keeps_gathered_input`), else every token."""
    tokens = inputs.local_seq_length * inputs.micro_batch
    if not inputs.model.sequence_parallel or keeps_gathered_input(inputs, layer_number):
        return tokens
    return tokens // inputs.tp


def _recomputed_layers(config: ModelConfig, layers: int) -> tuple[int, int]:
    """(layers recomputed in full, checkpointed groups) of a stage with `layers` layers: the
    first layers, as the runtime's `recompute_chunks` runs them."""
    if config.recompute_granularity != "full":
        return 0, 0
    recomputed = [stop - start for start, stop, again in recompute_chunks(config, layers) if again]
    return sum(recomputed), len(recomputed)


def stage_activation_bytes(
    inputs: PlanInputs,
    layers: int,
    first: bool,
    last: bool,
    layer_numbers: Sequence[int] | None = None,
) -> int:
    """Bytes one micro-batch leaves for backward on a stage with `layers` layers (without
    the logits, see `logits_bytes`); `layer_numbers`: their global numbers (each layer's
    context-parallel attention), else 1 to `layers`."""
    config = inputs.model
    size = dtypes(inputs)
    tokens = inputs.local_seq_length * inputs.micro_batch
    region = tokens // inputs.tp if config.sequence_parallel else tokens
    h = config.hidden_size
    recomputed, groups = _recomputed_layers(config, layers)
    group_input = region * h * size.residual
    if config.distribute_saved_activations:
        group_input //= inputs.tp
    numbers = list(layer_numbers or range(1, layers + 1))
    kept = sum(layer_bytes(inputs, layer_number=n) for n in numbers[recomputed:])
    total = kept + groups * group_input
    if first:
        # Token and position ids: Ulysses' parts are views of the whole batch's ids, context
        # parallelism's two chunks a copy of their own.
        ids = inputs.seq_length if inputs.sp > 1 else inputs.local_seq_length
        total += 2 * inputs.micro_batch * ids * 8
        if config.hidden_dropout > 0.0:
            total += region * h * size.mask
    if last:
        # The final norm's input and statistics, its output (the output layer's input).
        total += norm_bytes(config, size, region, h) + region * h * size.compute
        if config.mtp is not None:  # each module's layer is the last layer's kind
            layer = layer_bytes(inputs, layer_number=config.num_layers)
            norm = norm_bytes(config, size, region, h)
            # `hnorm` reads the final norm's output: the output layer's own input when it
            # keeps that output itself (no autocast copy) and the norm reads it as it is (not
            # RMSNorm's fp32 copy of a half one), not kept twice.
            read_as_is = config.normalization != "rmsnorm" or size.residual == _FP32
            shared = 0
            if size.compute == size.residual and read_as_is:
                shared = region * h * size.residual
            module = mtp_module_bytes(inputs, size, layer, norm) - shared
            total += config.mtp.num_layers * module
    return total


def autocast_copy_bytes(
    inputs: PlanInputs, layers: int, last: bool, layer_numbers: Sequence[int] | None = None
) -> int:
    """torch.autocast's half-precision copies of the weights a stage's matmuls use, kept by
    autograd until their backward: each of `layers` layers' four linear layers (a routed MoE
    layer's router and shared expert instead of the MLP's two; a recomputed layer casts again
    in its backward; none of an FP8 layer's, whose matmuls cast to FP8 themselves) and the
    output layer. One copy however many micro-batches are in flight:
    the cast cache lives as long as the autocast region, which spans a whole micro-batch
    (plain path) or the whole pipeline schedule. `layer_numbers`: as in
    `stage_activation_bytes`."""
    size = dtypes(inputs)
    if size.compute >= size.residual:
        return 0
    recomputed, _ = _recomputed_layers(inputs.model, layers)
    config, tp = inputs.model, inputs.tp
    h, proj = config.hidden_size, config.projection_size
    ffn = config.ffn_hidden_size
    mlp_in = 2 * ffn if config.gated else ffn
    # Under sequence parallelism a column-parallel layer (QKV, the MLP's first, the output
    # layer) casts inside its gather-and-matmul function, which keeps the fp32 weight and
    # casts it again in the backward: no copy of those is kept.
    gathered = config.sequence_parallel and tp > 1
    qkv = h * (proj + 2 * config.kv_projection_size)
    attention = (0 if gathered else qkv) + proj * h
    if config.mla is not None:
        attention = mla_weight_elements(config)
    numbers = list(layer_numbers or range(1, layers + 1))
    # A recomputed MLP or MoE layer casts without a graph: autograd keeps none of its copies.
    mlp = 0 if recomputes(config, "mlp") else (0 if gathered else h * mlp_in) + ffn * h

    def layer_copies(number: int) -> int:
        # An FP8 layer's linear layers hand their weights to torchao's matmul uncast.
        fp8 = runs_in_fp8(config, number)
        if is_routed_layer(config, number):
            routed = 0
            if not recomputes(config, "moe"):
                routed = routed_weight_copy_elements(config, fp8, tp, gathered)
            return (0 if fp8 else attention // tp) + routed
        return 0 if fp8 else (attention + mlp) // tp

    total = sum(layer_copies(number) for number in numbers[recomputed:])
    if last and not gathered:
        total += config.vocab_size // tp * h
        if config.mtp is not None:  # each module's projection and layer (the last's kind)
            module = mtp_weight_elements(config) // tp + layer_copies(config.num_layers)
            total += config.mtp.num_layers * module
    return total * size.compute


def logits_bytes(inputs: PlanInputs) -> int:
    """What the loss keeps for backward: this rank's [s, b, V / tp] logits."""
    tokens = inputs.local_seq_length * inputs.micro_batch
    return tokens * inputs.model.vocab_size // inputs.tp * dtypes(inputs).compute


def logits_working_bytes(inputs: PlanInputs) -> int:
    """The cross entropy's transient peak beside the kept logits: in the backward, the
    logits' gradient (their dtype) and chunks of fp32 scratch (the loss works over the
    vocabulary in row chunks of `CHUNK_BYTES`: 64 MiB on GPUs, 8 MiB on CPUs)."""
    tokens = inputs.local_seq_length * inputs.micro_batch
    vocab = inputs.model.vocab_size // inputs.tp
    budget = CHUNK_BYTES if inputs.device_type == "cuda" else CPU_CHUNK_BYTES
    chunk = min(tokens, max(1, budget // (_FP32 * vocab))) * vocab * _FP32
    # Live together: the chunk's softmax and the next one's shifted logits, and for half
    # logits the fp32 copy the subtraction makes first (measured: tests/planning).
    chunks = 2 if dtypes(inputs).compute == _FP32 else 3
    return tokens * vocab * dtypes(inputs).compute + chunks * chunk
