"""`--ckpt-format torch_dist` with Megatron-LM's MoE under expert parallelism: every expert is
saved, and the checkpoint resumes at another expert-parallel size.

The tiny LLaMA-style model of `llama_runs` with 4 routed experts (top-2, aux loss) in both
layers, fp32, on 4 ranks: EP=2 with the distributed optimizer (torch FSDP2: the experts are
sharded over the 2 ranks holding the same experts, their gradients averaged there and then
rescaled to Megatron-LM's sum / DP). Each EP rank holds 2 of the 4 experts' stacked weights
(and Adam's moments), which FSDP2 shards again over the 2 ranks holding them: each rank saves
its one expert as a slice of one [4, ...] tensor per layer, so no expert is lost to the
deduplication of replicas (the bug this guards against wrote one rank's 2 experts as the whole
stack). From the iteration-3 checkpoint of a 6-iteration run,
iterations 4-6 at the same layout are the run's bit for bit, and at EP=1 in one process (DDP-
free, the reference arithmetic) they are the same up to fp32 sums in other orders, gradient
norms included: the experts and their moments all loaded, and the sharded expert gradients
scaled as one process scales them.
"""

from __future__ import annotations

import os

import pytest

from megatron.checkpointing.dist_checkpoint import _SafeReader
from tests.checkpointing.compare import rolled_back
from tests.training.llama_runs import assert_same, run

ROUTED = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.01,
    moe_router_load_balancing_type="aux_loss",
    moe_grouped_gemm=True,
    ckpt_format="torch_dist",
    global_batch_size=8,
)


@pytest.mark.slow
def test_sharded_experts_saved_at_ep2_resume_at_ep2_and_ep1(stdlib_dataset: str, tmp_path) -> None:
    saved = str(tmp_path / "ep2")
    ep2 = dict(expert_model_parallel_size=2, use_distributed_optimizer=True, **ROUTED)
    straight = run(stdlib_dataset, 4, save=saved, save_interval=3, **ep2)
    assert [log["iteration"] for log in straight] == [1, 2, 3, 4, 5, 6]
    metadata = _SafeReader.create(os.path.join(saved, "iter_0000003")).read_metadata()
    for layer in (0, 1):
        for name in [f"language_model.encoder.layers.{layer}.mlp.experts.weight1"]:
            for key in (name, f"optimizer.state.{name}.exp_avg"):
                stored = metadata.state_dict_metadata[key]
                assert stored.size[0] == 4, (key, stored.size)
                # Each rank writes its own slices (its expert-parallel block of 2 experts,
                # sharded again by FSDP2 over the 2 ranks holding it): they tile all 4.
                rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in stored.chunks)
                assert [start for start, _ in rows] == [0, 1, 2, 3], (key, rows)
                assert all(end == start + 1 for start, end in rows), (key, rows)
    again = run(stdlib_dataset, 4, load=rolled_back(saved, 3, str(tmp_path / "a")), **ep2)
    assert [log["iteration"] for log in again] == [4, 5, 6]
    for mine, theirs in zip(again, straight[3:], strict=True):
        assert (mine["lm loss"], mine["grad norm"]) == (theirs["lm loss"], theirs["grad norm"])
    one = run(stdlib_dataset, 1, load=rolled_back(saved, 3, str(tmp_path / "b")), **ROUTED)
    assert_same(one, straight[3:])
    assert all(log["moe loss"] > 0 for log in one)
