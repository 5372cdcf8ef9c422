"""The tiny run the tests in tests/run start from: a 1-layer, 32-wide model, 32 training prompts,
4-token completions, metrics flushed every 0.2 s. A test file adds its own overrides after these
(later overrides win)."""

from __future__ import annotations

TINY_RUN: list[str] = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "task.n_train=32",
    "task.n_eval=8",
    "train.eval_max_examples=8",
    "train.batch_size=8",
    "train.num_generations=4",
    "train.max_completion_length=4",
    "logging.flush_every_s=0.2",
]
