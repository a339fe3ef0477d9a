"""A DeepSpeed config's "optimizer" / "scheduler" sections: accepted and set aside, as
Megatron-DeepSpeed does (it passes its own Adam and scheduler), with a line saying what is in
effect and a warning per value that differs from its flag."""

from __future__ import annotations

from tests.arguments.test_ds_config import validated

# The shape of the Zenn tutorial's ds_config_gpt2_345m_4.json: an optimizer section with lr,
# betas and max_grad_norm, a wandb section, fp16, steps_per_print 1.
TUTORIAL_CONFIG = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 1,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.00015, "betas": [0.9, 0.95], "max_grad_norm": 1.0},
    },
    "wandb": {"enabled": True, "project": "gpt2-345m"},
    "fp16": {"enabled": True},
}


def test_the_sections_are_set_aside_and_each_differing_value_is_named(tmp_path) -> None:
    args = validated(tmp_path, TUTORIAL_CONFIG, "--lr 3e-4 --clip-grad 1.0")
    assert "optimizer" not in args.deepspeed_config_dict  # DeepSpeed never sees it
    assert args.deepspeed_config_dict["wandb"] == TUTORIAL_CONFIG["wandb"]
    source = f"--deepspeed_config {tmp_path}/ds.json"
    assert args.deepspeed_config_notes == [
        f' > {source}: its "optimizer" section is not used (as in Megatron-DeepSpeed, whose own '
        "adam (lr 0.0003, betas (0.9, 0.999), eps 1e-08, weight decay 0.01, gradient clipping "
        "1.0) comes from the flags)",
        f' > warning: "optimizer.params.lr" (0.00015) in {source} differs from --lr (0.0003); '
        "--lr is in effect",
        f' > warning: "optimizer.params.betas" ([0.9, 0.95]) in {source} differs from '
        "--adam-beta1/--adam-beta2 ((0.9, 0.999)); --adam-beta1/--adam-beta2 is in effect",
    ]


def test_matching_values_and_a_scheduler_section(tmp_path) -> None:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 5, "total_num_steps": 20},
        },
    }
    args = validated(tmp_path, config, "--lr 1e-3 --lr-warmup-iters 5 --lr-decay-iters 10")
    notes = args.deepspeed_config_notes
    assert len(notes) == 3 and not set(config) & set(args.deepspeed_config_dict)
    assert "whose own LR schedule (linear from 0.001 to 0.0" in notes[1]
    assert notes[2].endswith(
        '"scheduler.params.total_num_steps" (20) in '
        f"--deepspeed_config {tmp_path}/ds.json differs from --lr-decay-iters (10); "
        "--lr-decay-iters is in effect"
    )


def test_another_optimizer_type_is_named(tmp_path) -> None:
    args = validated(tmp_path, {"optimizer": {"type": "Lamb", "params": {}}})
    assert '"optimizer.type" (Lamb)' in args.deepspeed_config_notes[1]
    assert args.deepspeed_config_notes[1].endswith(
        "is not the optimizer in effect: --optimizer adam"
    )


def test_no_sections_no_lines(tmp_path) -> None:
    assert validated(tmp_path, {}).deepspeed_config_notes == []
