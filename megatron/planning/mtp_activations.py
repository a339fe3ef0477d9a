"""What multi-token prediction keeps for backward on the last stage (`--mtp-num-layers D`,
megatron/model/multi_token_prediction.py), per micro-batch on one tensor-parallel rank, for
each of its D modules (T tokens, R = T / tp in sequence-parallel regions):

- the shifted token ids the embedding reads (int64) and the embedding's output, normalized
  (`enorm`), beside the previous hidden states, normalized (`hnorm`): two norms over R x h;
- their concatenation [T, 2h], the projection's input (in the compute dtype);
- one transformer layer of the last decoder layer's kind (`activations.layer_bytes`);
- the final norm, its output as the output layer's input, and the module's own logits
  [T, V / tp] (as the model's, `activations.logits_bytes`).

Under torch.autocast a module's residual stream starts from the projection's half output, so
its layer keeps half where the decoder's keeps fp32; the plan counts it as a decoder layer:
an overestimate of that difference (2% of a 2-layer toy model with one module, measured).
"""

from __future__ import annotations

from megatron.config import ModelConfig
from megatron.planning.dtypes import Dtypes
from megatron.planning.inputs import PlanInputs

_INT64 = 8


def mtp_module_bytes(inputs: PlanInputs, size: Dtypes, layer: int, norm: int) -> int:
    """One MTP module's bytes, given its transformer layer's (`layer`) and one norm's over
    R x h (`norm`)."""
    config, tp = inputs.model, inputs.tp
    tokens = inputs.local_seq_length * inputs.micro_batch
    rows = tokens // tp if config.sequence_parallel else tokens
    h = config.hidden_size
    total = tokens * _INT64 + 2 * norm + tokens * 2 * h * size.compute
    total += layer + norm + rows * h * size.compute  # the final norm and its output
    return total + tokens * config.vocab_size // tp * size.compute


def mtp_weight_elements(config: ModelConfig) -> int:
    """Per module, the projection's weight that torch.autocast casts (its transformer layer's
    are counted as a layer's; the output layer's copy is the model's own)."""
    return 2 * config.hidden_size * config.hidden_size
