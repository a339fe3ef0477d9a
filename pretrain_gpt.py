"""Pretrain GPT-2 with DeepSpeed (Megatron's flags). Not available yet in this release.

The data pipeline it will read from is ready: see tools/preprocess_data.py and
megatron/data/. Training arrives with the model and training releases.
"""

import sys

if __name__ == "__main__":
    print(
        "pretrain_gpt.py is not ready yet: this release ships the data pipeline "
        "(tools/preprocess_data.py, megatron.data); training comes next.",
        file=sys.stderr,
    )
    sys.exit(2)
