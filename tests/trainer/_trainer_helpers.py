"""Shared tiny setup for the trainer tests: a char-level tokenizer, a 2-layer model, 2 prompts.

`config` pins the precision on every device: fp32 (``bf16=False``) without gradient
checkpointing, so a test compares arithmetic, on CPU and on CUDA alike (where TRL's defaults
would otherwise turn on bf16 autocast and recomputation; test_trainer_gpu.py runs those).
`chain_length` is the n of tests/tolerances.py for a whole-model loss."""

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
        bf16=False,  # explicit: ComposerConfig's default is True on CUDA (TRL's GPU setting)
        gradient_checkpointing=False,  # likewise
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
    # These tiny random models read a hint no better than they answer without one, so channel 2's
    # teacher gate (on by default for users) would keep channel 2 off; tests of the channel's
    # plumbing and maths run it ungated (the teacher is still probed and logged), and the gate's
    # own tests (test_teacher_gate.py) pass sdpo_gate=True.
    kw.setdefault("sdpo_gate", False)
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


def chain_length(model: Any, inputs: dict[str, Any]) -> int:
    """n for `tolerances.tol` when two computations of a trainer loss (and its gradients) may
    group every rounded sum differently: per layer, attention over the longest sequence of the
    batch (the softmax's sum and the value dot products) and the MLP's down-projection (the
    intermediate size, the longest dot product of the layer), then the log-sum-exp over the
    vocabulary, then the sum over the batch's tokens (the loss's mean, the weight gradients)."""
    cfg = model.config
    lengths = [inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]]
    for key in ("sdpo_teacher_input_ids", "replay_chosen_ids"):
        if key in inputs:
            extra = inputs["prompt_ids"].shape[1] if key == "replay_chosen_ids" else 0
            lengths.append(inputs[key].shape[1] + extra)
    tokens = inputs["completion_ids"].numel()
    layer = max(lengths) + max(cfg.intermediate_size, cfg.hidden_size)
    return cfg.num_hidden_layers * layer + cfg.vocab_size + tokens
