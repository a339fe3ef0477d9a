"""Oracle job: megatron-core's own rank groups, run with megatron-core importable as `megatron`.

Usage: python megatron_core_rank_groups.py CASES.json OUT.json, where CASES.json lists
[world, tp, pp] triples. For each, megatron-core 0.16.1's `RankGenerator` (the default
order "tp-cp-ep-dp-pp", cp = ep = 1) gives the groups its `initialize_model_parallel`
creates: "tp", "dp", "pp", "tp-pp" (the model-parallel group) and, from each pipeline group,
`default_embedding_ranks` (first and last stage). OUT.json maps "world,tp,pp" to them.

Only `megatron/core/parallel_state.py` is needed: `megatron.core` is registered as a bare
package so that its `__init__` (which imports the whole library, seconds) does not run.
"""

import json
import os
import sys
import types

core = types.ModuleType("megatron.core")
core.__path__ = [os.path.join(os.getcwd(), "megatron", "core")]
sys.modules["megatron.core"] = core

from megatron.core.parallel_state import RankGenerator, default_embedding_ranks  # noqa: E402


def groups(world: int, tp: int, pp: int) -> dict:
    """Every group kind megatron-core builds for this world (ranks in megatron-core's order)."""
    generator = RankGenerator(
        tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    pipeline = generator.get_ranks("pp")
    return {
        "tensor": generator.get_ranks("tp"),
        "data": generator.get_ranks("dp"),
        "pipeline": pipeline,
        "model": generator.get_ranks("tp-pp"),
        "embedding": [default_embedding_ranks(ranks) for ranks in pipeline],
    }


def main() -> None:
    """Read the cases, write megatron-core's groups for each."""
    with open(sys.argv[1]) as stream:
        cases = json.load(stream)
    result = {f"{w},{tp},{pp}": groups(w, tp, pp) for w, tp, pp in cases}
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
