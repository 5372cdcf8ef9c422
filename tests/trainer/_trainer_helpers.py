"""Shared tiny setup for the trainer tests: a char-level tokenizer, a 2-layer model, 2 prompts."""

from __future__ import annotations

from typing import Any

import torch

from composer_replication.data import TraceRecord, TraceStore, prompt_key
from composer_replication.models import build_tiny_model, build_tokenizer
from composer_replication.trainer import ComposerConfig, ComposerReplicationTrainer

PROMPTS = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "3+4="}]]
ANSWERS = ["3", "7"]
G = 4  # generations per prompt


def text_of(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def positional_reward(prompts, completions, **kwargs):
    """First rollout of each group succeeds; the others fail with feedback (deterministic)."""
    out = []
    for i, c in enumerate(completions):
        if i % G == 0:
            out.append((1.0, None))
        else:
            out.append((0.0, f"wrong: you wrote {text_of(c)[:3]!r}"))
    return out


def plain_reward(prompts, completions, **kwargs):
    return [float(len(text_of(c)) % 3) / 2.0 for c in completions]


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS, "answer": ANSWERS})


def oracle_store() -> TraceStore:
    return TraceStore(
        TraceRecord(prompt_key(p), "oracle", a + " done", 1.0) for p, a in zip(PROMPTS, ANSWERS)
    )


def config(tmp_path, **overrides) -> ComposerConfig:
    opts: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2 * G,
        num_generations=G,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        learning_rate=1e-2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    opts.update(overrides)
    return ComposerConfig(**opts)


def make_trainer(
    tmp_path, *, reward=positional_reward, store=None, cls=None, args=None, save_to=None, **kw
):
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, seed=0)
    if save_to is not None:  # plain TRL reloads its reference model from _name_or_path
        model.save_pretrained(save_to)
        model.config._name_or_path = str(save_to)
    trainer_cls = cls or ComposerReplicationTrainer
    extra = {} if trainer_cls is not ComposerReplicationTrainer else {"trace_store": store, **kw}
    trainer = trainer_cls(
        model=model,
        reward_funcs=[reward],
        args=args or config(tmp_path),
        train_dataset=dataset(),
        processing_class=tok,
        **extra,
    )
    # Set by Trainer's training loop; the tests call compute_loss directly.
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def generation_batch(trainer) -> dict[str, Any]:
    """One generation batch, exactly as training would build it (train mode, fixed seed)."""
    torch.manual_seed(0)
    trainer.model.train()
    rows = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS) for _ in range(G)]
    return trainer._generate_and_score_completions(rows)


def loss_and_grads(trainer, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {
        n: p.grad.detach().clone()
        for n, p in trainer.model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads
