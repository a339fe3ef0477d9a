"""`pretrain_gpt.py` under Megatron-LM v1's name, which DeepSpeed's Megatron-LM GPT-2 tutorial runs.

    bash scripts/ds_pretrain_gpt2.sh     # the tutorial's scripts call `pretrain_gpt2.py ...`
    deepspeed pretrain_gpt2.py --batch-size 8 --train-data webtext ... --deepspeed ...

Every flag of `pretrain_gpt.py` works here, and so do v1's own (`--batch-size`,
`--model-parallel-size`, `--warmup .01`, `--train-data webtext`, ...; see docs/arguments.md).
"""

from __future__ import annotations

import sys

from pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
