"""Which layers each pipeline stage holds (pure arithmetic, no communication).

With PP pipeline ranks and V virtual stages per rank (Megatron's interleaved schedule) the
model is cut into PP x V chunks of L / (PP x V) consecutive layers; chunk c of pipeline rank r
is stage c x PP + r, so rank 0 holds stages 0, PP, 2 PP, ... (Megatron-LM's assignment, and
torch.distributed.pipelining's looped stage-to-rank mapping).
"""

from __future__ import annotations


def stage_index(pp_rank: int, chunk: int, pp_size: int) -> int:
    """The global stage number of model chunk `chunk` on pipeline rank `pp_rank`."""
    return chunk * pp_size + pp_rank


def chunk_layer_numbers(
    num_layers: int, pp_size: int, virtual_size: int, pp_rank: int, chunk: int
) -> range:
    """Global 1-based layer numbers of model chunk `chunk` on pipeline rank `pp_rank`."""
    stages = pp_size * virtual_size
    if num_layers % stages != 0:
        raise ValueError(
            f"{num_layers} layers cannot be split evenly into {pp_size} pipeline stages x "
            f"{virtual_size} virtual stages"
        )
    per_chunk = num_layers // stages
    first = stage_index(pp_rank, chunk, pp_size) * per_chunk
    return range(first + 1, first + per_chunk + 1)


def bubble_fraction(pp_size: int, virtual_size: int, microbatches: int) -> float:
    """The idle share of a 1F1B step the schedule predicts: (PP - 1) / (V x m + PP - 1).

    Narayanan et al. 2021: the bubble is (PP - 1) forward+backward slots of one micro-batch
    through one stage; a stage spends m of them on work (m x V slots of 1/V the size when
    interleaved).
    """
    return (pp_size - 1) / (virtual_size * microbatches + pp_size - 1)
