"""The `--dry-run` planner: each rank's peak memory, communication bytes, FLOPs and a roofline
step time, from the validated flags and a small device table; it needs no device.

- `inputs.py`: `PlanInputs`, the job as the planner sees it (typed once from the flags);
- `layout.py`: rank roles (parameters, layers, micro-batches in flight per pipeline stage);
- `model_states.py`: weights, gradients, optimizer state and buffers by engine and by the
  optimizer wrapper DeepSpeed runs (`megatron/deepspeed_facts.py`);
- `dtypes.py`: the element sizes of saved tensors on each precision path;
- `activations.py`, `memory.py`: what each rank holds, and its peak;
- `routed_moe.py`: Megatron-LM MoE layers' activations and dispatcher bytes;
- `communication.py`: collective payload bytes per iteration, by kind;
- `fp8.py`: FP8 matmuls' transient copies (as torchao allocates them) and FP8 FLOPs;
- `devices.py`, `roofline.py`: known GPUs; step time and MFU;
- `suggestions.py`: changes that shrink a rank's peak;
- `plan.py`: `build_plan`, `format_plan`, and the JSON of `--dry-run-json`.
"""
