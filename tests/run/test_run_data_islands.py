"""Data islands (`[task] shard`): with "disjoint" (the default) no training prompt reaches two
replicas; with "shared" every replica samples from all of them. Checked on what TRL's sampler
really hands each replica's trainer, not on the split alone."""

from __future__ import annotations

import tempfile

import pytest

from composer_replication.assembly.build import (
    build_model,
    build_task,
    build_trainer,
    hinted_examples,
    train_split,
)
from composer_replication.config import ConfigError, load_config

SMALL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "task.n_train=24",
    "task.n_eval=4",
    "train.batch_size=8",
    "train.num_generations=4",
    "backend.n_replicas=3",
]


def _prompts_seen(config, rank: int, batches: int) -> set[str]:  # type: ignore[no-untyped-def]
    """The prompts replica `rank`'s trainer draws in its first `batches` training batches."""
    task = build_task(config)
    model, tok = build_model(config)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(
            config,
            model=model,
            tokenizer=tok,
            task=task,
            max_steps=batches,
            seed=config.run.seed + 1000 * rank,
            output_dir=scratch,
            rank=rank,
        )
        seen: set[str] = set()
        for i, batch in enumerate(trainer.get_train_dataloader()):
            if i == batches:
                break
            seen |= {row["prompt"][-1]["content"] for row in batch}
    return seen


def test_disjoint_islands_share_no_prompt_and_cover_the_training_set() -> None:
    assert load_config(overrides=SMALL).task.shard == "disjoint"  # the default
    config = load_config(overrides=[*SMALL, "task.hint_share=0"])  # hinted prompts: below
    # each island has 8 prompts; 2 prompts per step: 8 batches go around each island twice
    seen = [_prompts_seen(config, rank, batches=8) for rank in range(3)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not seen[a] & seen[b], (a, b, seen[a] & seen[b])
    train = {ex.prompt for ex in build_task(config).train_examples()}
    assert [len(s) for s in seen] == [8, 8, 8]
    assert set().union(*seen) == train


def test_the_hinted_examples_are_split_into_the_islands_too() -> None:
    """The default also trains a share of its prompts under the hint (`task.hint_share`): each
    hinted example sits on one island, and the islands together hold every plain and hinted
    prompt once."""
    config = load_config(overrides=SMALL)
    task = build_task(config)
    hinted = hinted_examples(config, task)
    assert len(hinted) == 3
    islands = [train_split(config, task, rank) for rank in range(3)]
    rows = [p[-1]["content"] for island in islands for p in island["prompt"]]
    assert sorted(rows) == sorted(ex.prompt for ex in (*task.train_examples(), *hinted))
    assert [sum(island["hinted_example"]) for island in islands] == [1, 1, 1]


def test_shared_replicas_sample_from_every_prompt() -> None:
    config = load_config(overrides=[*SMALL, "task.shard=shared"])
    seen = [_prompts_seen(config, rank, batches=12) for rank in range(2)]
    assert seen[0] & seen[1]  # both draw from the whole set (24 prompts, 24 draws each)
    assert len(seen[0]) > 8 and len(seen[1]) > 8


def test_an_island_too_small_for_one_step_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="task.shard: 'disjoint' gives each of the 3 replicas 1"):
        load_config(overrides=[*SMALL, "task.n_train=5"])
    load_config(overrides=[*SMALL, "task.n_train=5", "task.shard=shared"])  # fine when shared
