"""The seeds' Recipe 1 (TRL `GRPOTrainer` subclass), sections 3-5, as a user would paste them.

Adapted only where the seed names something this machine cannot reach, each marked `# adapted`:
the hub model and dataset (`Qwen/Qwen2.5-0.5B-Instruct`, `trl-lib/tldr`) become the tiny local
model and a local dataset, the `s3://` bucket a `file://` store, and the run is 2 steps long
(`args=GRPOConfig(max_steps=2, ...)`). Everything else (the keyword names, `MockManager`,
`make_diloco_outer_loop(inner_optimizer=trainer.optimizer, ...)` before `train()`,
`outer.callback()`) is the seed's text. Recipe 4 is tests/diloco/test_diloco_examples.py;
Recipes 2, 3 and 5 are the recipe tests under tests/recipes and tests/executors/test_arg_style.py.
docs/recipes/trl.md shows section 3 as its minimal example.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _model_and_data():  # type: ignore[no-untyped-def]
    from datasets import Dataset

    from composer_replication.models import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()  # adapted: no hub model
    model = build_tiny_model(tokenizer)
    dataset = Dataset.from_dict({"prompt": [f"Summarise: item {i}" for i in range(32)]})
    return model, tokenizer, dataset


def _args(tmp_path: Path):  # type: ignore[no-untyped-def]
    from trl import GRPOConfig

    return GRPOConfig(  # adapted: a 2-step CPU run
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        report_to=[],
        use_cpu=True,
    )


def reward_length(completions, **_):  # type: ignore[no-untyped-def]
    return [-abs(len(c) - 64) for c in completions]


def test_recipe1_script_and_diloco_wiring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_replication import ComposerReplicationTrainer

    model, tokenizer, dataset = _model_and_data()
    # --- section 3, minimum-viable script
    trainer = ComposerReplicationTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward_length],
        train_dataset=dataset,
        args=_args(tmp_path),  # adapted
        # Composer extras (defaults shown):
        alpha_sdpo=0.1,
        beta_replay=0.05,
        sdpo_jsd_beta=0.5,
        sdpo_temperature=1.0,
        sdpo_token_clip=None,
        replay_dpo_beta=0.1,
    )
    # --- section 4, what each replica runs
    monkeypatch.setenv("REPLICA_RANK", "0")  # the executor sets it
    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.diloco.serverless import MockManager, ObjectStoreAllReduce

    store = tmp_path / "store"
    rendezvous = ObjectStoreAllReduce(
        uri=store.as_uri() + "/",  # adapted: s3://my-bucket/diloco-runs/run42/
        world_size=1,  # adapted: 4 replicas in the seed; one process here
        rank=int(os.environ["REPLICA_RANK"]),
    )
    manager = MockManager(allreduce=rendezvous)
    # trainer.optimizer is the *inner* optimizer; the outer is built here:
    outer = make_diloco_outer_loop(
        inner_optimizer=trainer.optimizer,
        manager=manager,
        sync_every_h=1,  # adapted: 500 in the seed; the run is 2 steps
    )
    trainer.add_callback(outer.callback())  # syncs every H inner steps
    c = trainer.composer
    assert (c.alpha_sdpo, c.beta_replay, c.sdpo_jsd_beta, c.replay_dpo_beta) == (
        0.1,
        0.05,
        0.5,
        0.1,
    )
    trainer.train()
    # two outer rounds were committed through the store, on top of the initial global state
    states = sorted(p.name for p in (store / "states" / "global").iterdir())
    assert states == ["0000000000.safetensors", "0000000001.safetensors", "0000000002.safetensors"]


def test_recipe1_distillation_loss_wiring(tmp_path: Path) -> None:
    from composer_replication import ComposerReplicationTrainer

    model, tokenizer, dataset = _model_and_data()
    # --- section 5
    trainer = ComposerReplicationTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward_length],
        train_dataset=dataset,
        args=_args(tmp_path),  # adapted
        # SimPO instead of DPO for channel 3:
        dpo_variant="simpo",
        simpo_beta=2.0,
        simpo_gamma=1.0,
        # TAID for channel 2 (SakanaAI port; logit-space mix + forward-KL):
        sdpo_wrapper="taid",
        taid_t=0.4,  # current TAID coeff in [0, 1];
    )
    c = trainer.composer  # the settings the loss is called with
    assert (c.dpo_variant, c.simpo_beta, c.simpo_gamma) == ("simpo", 2.0, 1.0)
    assert (c.sdpo_wrapper, c.taid_t) == ("taid", 0.4)
    assert (c.alpha_sdpo, c.beta_replay) == (0.1, 0.05)  # the defaults the seed shows
    result = trainer.train()
    assert result.global_step == 2


def test_docs_minimal_example_runs_as_written(tmp_path: Path) -> None:
    """docs/recipes/trl.md's section 3, from the doc's own text (its output_dir "out" lands in
    the working directory)."""
    from docblocks import run_doc_block

    run_doc_block("docs/recipes/trl.md", "reward_funcs=[reward_length]", cwd=tmp_path, timeout=280)
