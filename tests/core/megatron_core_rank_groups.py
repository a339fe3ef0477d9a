"""Oracle job: megatron-core's own rank groups, run with megatron-core importable as `megatron`.

Usage: python megatron_core_rank_groups.py CASES.json OUT.json, where CASES.json lists
[world, tp, pp] triples, [world, tp, pp, cp] quadruples or [world, tp, pp, cp, ep] (expert
parallelism: also its expert groups at expert tensor parallelism 1, `expert_groups`). For
each, megatron-core 0.16.1's `RankGenerator` (the default order "tp-cp-ep-dp-pp", ep = 1)
gives the groups its `initialize_model_parallel` creates: "tp", "dp", "pp", "tp-pp" (the
model-parallel group), from each pipeline group `default_embedding_ranks` (first and last
stage), with cp > 1 "cp" and "dp-cp" (the data-parallel group with context parallel), and
with pp > 1 "tp-dp-cp" (every rank of a pipeline stage, where the expert-bias loads are
summed). OUT.json maps the case's numbers joined by commas to them.

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


def expert_groups(world: int, pp: int, ep: int) -> dict:
    """megatron-core's expert groups at `--expert-tensor-parallel-size 1` (MoE parallel
    folding): its expert RankGenerator (order "tp-ep-dp-pp", expert TP 1, no CP) "ep" and
    "dp" (expert data parallel) groups, as its `initialize_model_parallel` builds them."""
    generator = RankGenerator(tp=1, ep=ep, dp=world // (pp * ep), pp=pp, cp=1, order="tp-ep-dp-pp")
    return {"expert": generator.get_ranks("ep"), "expert_data": generator.get_ranks("dp")}


def groups(world: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    """Every group kind megatron-core builds for this world (ranks in megatron-core's order)."""
    generator = RankGenerator(
        tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp"
    )
    pipeline = generator.get_ranks("pp")
    context = {}
    if cp > 1:
        context = {
            "sequence": generator.get_ranks("cp"),
            "sequence_data": generator.get_ranks("dp-cp"),
        }
    if pp > 1:  # every rank of a stage: megatron-core's tensor-and-data group with context
        context["stage"] = generator.get_ranks("tp-dp-cp")
    if ep > 1:
        context |= expert_groups(world, pp, ep)
    return context | {
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
    result = {",".join(map(str, case)): groups(*case) for case in cases}
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
