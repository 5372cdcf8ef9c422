"""What a replica's exchange needs to screen contributions, built from the run config
(docs/object-store.md).

- `aggregate_policy(config, task, tokenizer)`: `[diloco] aggregate*` / `screen*` plus the claim
  bounds only the run knows: at most ``sync_every_h`` inner steps per round, and at most
  ``batch_size x gradient_accumulation_steps x (longest chat prompt the run trains on +
  max_completion_length)`` tokens per inner step (the tokens TRL counts: prompt plus completion
  of every sequence of the step's generation batch).
- `loss_probe(config, global_weights, model, tokenizer, task)` (``screen = "loss"``): the held-out loss
  the global model would have if one contribution alone were the round's average and applied
  by a plain outer step, ``global - outer_lr * candidate``: the mean token NLL of the task's
  reference answers for ``screen_examples`` held-out prompts. The candidate's tensors are the
  exchange's names ``p000000, p000001, ...``: DiLoCo sends one pseudo-gradient per parameter,
  in ``named_parameters()`` order, of a run's single fragment (the whole model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from composer_replication.diloco.mode_protocol import GlobalWeights
from composer_replication.exchange.contribution_screening import AggregatePolicy, LossProbe

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from composer_replication.config import RunConfig
    from composer_replication.tasks import Task

__all__ = ["RunScreening", "aggregate_policy", "loss_probe", "max_tokens_per_step"]


class RunScreening:
    """The run's screening as the outer loop's `Screening` (built only when the mode's exchange
    asks for it: a decoupled or torchft run never tokenizes the prompts for claim bounds)."""

    def __init__(
        self,
        config: RunConfig,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
    ) -> None:
        self.config, self.model, self.tokenizer, self.task = config, model, tokenizer, task

    def policy(self) -> AggregatePolicy:
        return aggregate_policy(self.config, self.task, self.tokenizer)

    def probe(self, global_weights: GlobalWeights) -> LossProbe | None:
        return loss_probe(self.config, global_weights, self.model, self.tokenizer, self.task)


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    from composer_replication.tasks.task import chat_prompt

    ids = tokenizer.apply_chat_template(
        chat_prompt(prompt), tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def max_tokens_per_step(config: RunConfig, task: Task, tokenizer: PreTrainedTokenizerBase) -> int:
    """The most tokens one inner step can count (see the module docstring): over every prompt
    the run trains on, its hinted examples (`task.hint_share`, the longest) included."""
    from composer_replication.assembly.build import hinted_examples

    examples = (*task.train_examples(), *hinted_examples(config, task))
    longest = max(len(_prompt_ids(tokenizer, ex.prompt)) for ex in examples)
    t = config.train
    return t.batch_size * t.gradient_accumulation_steps * (longest + t.max_completion_length)


def aggregate_policy(
    config: RunConfig, task: Task, tokenizer: PreTrainedTokenizerBase
) -> AggregatePolicy:
    """The exchange's screening policy for this run, with its claim bounds."""
    return config.diloco.exchange.aggregate_policy(
        max_tokens_per_step=max_tokens_per_step(config, task, tokenizer),
        max_inner_steps=config.diloco.sync_every_h,
    )


def loss_probe(
    config: RunConfig,
    global_weights: GlobalWeights,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
) -> LossProbe | None:
    """The held-out loss callback of ``screen = "loss"`` (None otherwise). ``global_weights``
    returns the outer loop's current global weights (`DiLoCoOuterLoop.global_parameters`)."""
    if config.diloco.exchange.screen != "loss":
        return None
    import torch

    examples = task.eval_examples()[: config.diloco.exchange.screen_examples]
    if not examples:
        raise ValueError("diloco.screen = 'loss' needs held-out prompts: set task.n_eval >= 1")
    batch = []
    for ex in examples:
        prompt = _prompt_ids(tokenizer, ex.prompt)
        solution = task.oracle(ex)
        if not solution:
            raise ValueError(
                f"diloco.screen = 'loss' scores the task's reference answers, and task "
                f"{task.name!r} has none for {ex.id!r} (an openenv task needs "
                "task.options.answer_field); use another diloco.screen"
            )
        answer = tokenizer(solution, add_special_tokens=False)["input_ids"]
        batch.append((prompt, list(answer)))
    lr = config.diloco.outer.outer_lr

    @torch.no_grad()
    def probe(candidate: Mapping[str, torch.Tensor]) -> float:
        params = list(model.named_parameters())
        if len(candidate) != len(params):
            raise ValueError(
                f"loss probe: {len(candidate)} tensors for {len(params)} parameters (the probe "
                "needs the whole model as one fragment)"
            )
        glob = global_weights()
        local = [p.detach().clone() for _, p in params]
        was_training = model.training
        model.eval()
        try:
            for i, (name, p) in enumerate(params):
                delta = candidate[f"p{i:06d}"].to(device=p.device, dtype=torch.float32)
                new = glob[f"f0.{name}"].to(p.device, torch.float32) - lr * delta
                p.copy_(new.to(p.dtype))
            return _mean_nll(model, batch)
        finally:
            for (_, p), saved in zip(params, local):
                p.copy_(saved)
            model.train(was_training)

    return probe


def _mean_nll(model: PreTrainedModel, batch: list[tuple[list[int], list[int]]]) -> float:
    """Mean negative log-likelihood of the answer tokens given their prompts."""
    import torch

    device = next(model.parameters()).device
    total, count = 0.0, 0
    for prompt, answer in batch:
        ids = torch.tensor([prompt + answer], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        target = ids[0, len(prompt) :]
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        total += float(nll)
        count += len(answer)
    return total / max(count, 1)
