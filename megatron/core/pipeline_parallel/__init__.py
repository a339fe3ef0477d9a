"""Megatron's pipeline parallelism without DeepSpeed, on `torch.distributed.pipelining`.

- `layout.py`: which layers each stage and virtual stage (model chunk) holds, Megatron's rule.
- `schedules.py`: the 1F1B and interleaved 1F1B schedules (torch's `Schedule1F1B` and
  `ScheduleInterleaved1F1B` over `PipelineStage`s of this rank's chunks), the tied embedding's
  gradient all-reduce between the first and last stage, the data-parallel gradient average.
- `combined_1f1b.py`: Megatron-LM's combined 1F1B at PP = 1 (`--overlap-moe-expert-parallel-comm`):
  a micro-batch's backward beside the next one's forward, handing over at the expert
  collectives.
"""
