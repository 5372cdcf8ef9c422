"""What a replica reports while it trains: metrics, status, evaluations and checkpoints.

`ReplicaReporter` is a Hugging Face `TrainerCallback` added AFTER the DiLoCo callback, so in
`on_step_end` it sees an outer round that has just been committed (the model then holds the new
global weights, identical on every replica) and in `on_train_end` the final global weights.

- the "train_begin" event carries what the mode adds (`ReplicaLoop.begin_fields`; a decoupled
  learner: what binding downloaded, ``rejoin_bytes``, ``rejoin_objects``,
  ``rejoin_merged_meanwhile``: `RejoinRecord`);
- every TRL log line becomes a "train" record (step = inner step of the whole run: the trainer
  of a relaunched replica continues at its start step);
- every exchange in the manager's history becomes a "round" record (seconds, bytes, ranks,
  store requests by kind, how many contributions were rejected), and every rejection an
  "event" record (``event = "rejected"``, ``rank``, ``reason``) and the status document's
  ``rejections`` (the latest round that rejected something); a committed update a replica
  refused to apply (unsigned runs' global-update screening) an "event" record
  (``event = "refused"``, ``round``, ``reason``);
- replica `evaluator_rank` (0) evaluates the global model on held-out prompts every
  `eval_every_rounds` committed rounds and at the end, and writes checkpoints;
- the status document (state, step, round, reward) is refreshed with every flush.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.data.turns import stop_token_ids
from composer_replication.diloco.mode_protocol import OuterLoop
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.store_manager import RoundRecord
from composer_replication.json_types import JSONValue
from composer_replication.run.checkpoint import prune_checkpoints, round_dir, save_checkpoint
from composer_replication.run.metrics import ReplicaMetricsWriter
from composer_replication.tasks.task import decode_completion

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the replica needs transformers: pip install composer-replication[train]"
    ) from exc

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from composer_replication.tasks import Example, Task

__all__ = ["ReplicaReporter", "evaluate", "greedy_completions"]

_SKIP_LOG_KEYS = ("epoch", "total_flos", "train_runtime")


@torch.no_grad()
def greedy_completions(
    model: Any,  # a PreTrainedModel: transformers' `generate` has no types mypy can follow
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[str]:
    """The greedy completion of each user prompt in `prompts`, in order, as the verifier judges
    it (`tasks.decode_completion`: cut at the first of the model's stop tokens, special tokens
    kept; the training reward decodes the same way); the model's train/eval mode is restored
    afterwards."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    completions: list[str] = []
    stops = stop_token_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for prompt in chunk
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(device) for k, v in enc.items()}
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            completions += [
                decode_completion(tokenizer, row, stops)
                for row in out[:, enc["input_ids"].shape[1] :].tolist()
            ]
    finally:
        model.train(was_training)
    return completions


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    *,
    max_new_tokens: int,
    batch_size: int = 64,
) -> dict[str, float]:
    """Greedy completions for `examples`, judged by the task: accuracy and mean reward."""
    if not examples:
        return {}
    completions = greedy_completions(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    correct = 0
    reward = 0.0
    for ex, completion in zip(examples, completions, strict=True):
        verdict = task.verify(ex, completion)
        correct += int(verdict.correct)
        reward += float(verdict.reward)
    n = len(examples)
    return {"eval/accuracy": correct / n, "eval/reward": reward / n, "eval/n": float(n)}


class ReplicaReporter(TrainerCallback):
    """See the module docstring. The trainer counts the run's inner steps (a relaunched
    replica's trainer continues at its start step), so a step here is the run's."""

    def __init__(
        self,
        *,
        writer: ReplicaMetricsWriter,
        store: ObjectStore,
        outer: OuterLoop,
        rank: int,
        max_steps: int,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        eval_examples: list[Example],
        eval_every_rounds: int,
        max_new_tokens: int,
        checkpoint_every_rounds: int,
        keep_last: int,
        save_final: bool,
        evaluator_rank: int = 0,
        begin_fields: Callable[[], Mapping[str, JSONValue]] = dict,
        last_round: int | None = None,
        ood_examples: list[Example] | None = None,
    ) -> None:
        self.writer = writer
        self.store = store
        self.outer = outer
        self.begin_fields = begin_fields  # the mode's fields of the "train_begin" event
        self.rank = rank
        self.max_steps = max_steps
        self.tokenizer = tokenizer
        self.task = task
        self.eval_examples = eval_examples
        self.ood_examples = ood_examples or []  # the task's out-of-distribution row
        self.eval_every_rounds = eval_every_rounds
        self.max_new_tokens = max_new_tokens
        self.checkpoint_every_rounds = checkpoint_every_rounds
        self.keep_last = keep_last
        self.save_final = save_final
        self.is_evaluator = rank == evaluator_rank
        self.last_round = last_round  # sync mode: training stops once it is committed
        self._history_seen = 0
        self._round_started: float | None = None  # when the current round's inner steps began
        self._last_eval_round: int | None = None
        self._last_ckpt_round: int | None = None
        self._reward: float | None = None

    # -- helpers
    def _step(self, state: TrainerState) -> int:
        return int(state.global_step)

    def _round(self) -> int:
        return int(self.outer.round)

    def _status(self, state_name: str, step: int, *, force: bool = False, **extra: object) -> None:
        self.writer.status(
            force=force,
            state=state_name,
            step=step,
            max_steps=self.max_steps,
            round=self._round(),
            reward=self._reward,
            **extra,
        )

    def evaluate_now(self, model: PreTrainedModel, step: int) -> None:
        self._status("evaluating", step, force=True)
        metrics = evaluate(
            model,
            self.tokenizer,
            self.task,
            self.eval_examples,
            max_new_tokens=self.max_new_tokens,
        )
        if metrics and self.ood_examples:
            ood = evaluate(
                model,
                self.tokenizer,
                self.task,
                self.ood_examples,
                max_new_tokens=self.max_new_tokens,
            )
            metrics.update({"eval/ood_accuracy": ood["eval/accuracy"], "eval/ood_n": ood["eval/n"]})
        if metrics:
            self.writer.log("eval", step=step, round=self._round(), **metrics)
            self.writer.status(eval_accuracy=metrics["eval/accuracy"])
        self._last_eval_round = self._round()

    def checkpoint_now(self, model: PreTrainedModel, step: int, name: str | None = None) -> None:
        rnd = self._round()
        # The global weights go to model.safetensors; the outer optimizer state (momentum) is
        # the same on every replica after a committed round, so it is taken from this one.
        save_checkpoint(
            self.store,
            name=name or round_dir(rnd),
            model=model,
            tokenizer=self.tokenizer,
            round=rnd,
            step=step,
            outer_state=self.outer.outer_optimizer_state(),
        )
        prune_checkpoints(self.store, self.keep_last)
        self._last_ckpt_round = rnd

    # -- callback events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        step = self._step(state)
        # what the mode adds (a decoupled learner: what binding downloaded, `RejoinRecord`)
        extra = self.begin_fields()
        self.writer.log("event", step=step, round=self._round(), event="train_begin", **extra)
        self._status("training", step, force=True)
        model = kwargs.get("model")
        if self.is_evaluator and step == 0 and model is not None:
            self.evaluate_now(model, step)  # the baseline: global weights before any training
            self._status("training", step, force=True)
        self._round_started = time.monotonic()  # after the baseline evaluation

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, JSONValue] | None = None,
        **kwargs: object,
    ) -> None:
        if not logs or "train_runtime" in logs:
            return
        values = {
            k: float(v)
            for k, v in logs.items()
            if k not in _SKIP_LOG_KEYS and isinstance(v, int | float) and not isinstance(v, bool)
        }
        if "reward" in values:
            self._reward = values["reward"]
        step = self._step(state)
        self.writer.log("train", step=step, round=self._round(), **values)
        self._status("training", step)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        step = self._step(state)
        committed = self.log_new_rounds(step)
        if (
            self.last_round is not None
            and self._round() >= self.last_round > 0
            and (step < self.max_steps)
        ):
            # healed onto the run's last round (it stalled while the others finished): there
            # is nothing left to synchronise, and training on would commit rounds past the end
            self.writer.log("event", step=step, round=self._round(), event="last_round_reached")
            control.should_training_stop = True
        if not committed or not self.is_evaluator:
            return
        model = kwargs.get("model")
        rnd = self._round()
        if self.eval_every_rounds and rnd % self.eval_every_rounds == 0 and model is not None:
            self.evaluate_now(model, step)
        if (
            self.checkpoint_every_rounds
            and rnd % self.checkpoint_every_rounds == 0
            and model is not None
        ):
            self._status("checkpointing", step, force=True)
            self.checkpoint_now(model, step)
        self._round_started = time.monotonic()  # evaluation and checkpoint are not training
        self._status("training", step)

    def log_new_rounds(self, step: int) -> bool:
        """Log the exchanges of the outer loop's history not logged yet (also when a round
        that cannot commit stops the replica); whether one of them committed."""
        history = self.outer.history
        new = history[self._history_seen :]
        self._history_seen = len(history)
        committed = False
        now = time.monotonic()
        for record in new:
            self._log_round(record, step, now)
            committed = committed or bool(record.get("committed"))
        return committed

    def _log_round(self, record: RoundRecord, step: int, now: float) -> None:
        """One exchange of the outer loop's history: a "round" record (throughput and where
        the round's wall time went, from the end of the previous round or train start to the
        end of this exchange), and an "event" record per rejected contribution."""
        rnd = int(record.get("round", 0))
        rejected = dict(record.get("rejected") or {})
        wall = None if self._round_started is None else now - self._round_started
        self._round_started = now
        wait = float(record.get("wait_seconds") or 0.0)
        steps, tokens = record.get("inner_steps"), record.get("tokens")
        pace = {}
        if wall and wall > 0:
            pace = {
                "round/wall_s": wall,
                "round/steps_per_s": (steps or 0) / wall,
                "round/tokens_per_s": None if tokens is None else tokens / wall,
                "round/wait_fraction": min(1.0, wait / wall),
                "round/train_s": max(0.0, wall - float(record.get("seconds") or 0.0)),
            }
            self.writer.status(
                steps_per_s=pace["round/steps_per_s"], wait_fraction=pace["round/wait_fraction"]
            )
        requests = {f"round/requests_{k}": v for k, v in (record.get("requests") or {}).items()}
        self.writer.log(
            "round",
            step=step,
            round=rnd,
            **{
                "round/seconds": record.get("seconds"),
                "round/bytes_up": record.get("bytes_uploaded"),
                "round/bytes_down": record.get("bytes_downloaded"),
                "round/included": record.get("participants"),
                "round/committed": bool(record.get("committed")),
                "round/healed": bool(record.get("healed")),
                "round/rejected": len(rejected),
                "round/upload_s": record.get("upload_seconds"),
                "round/wait_s": record.get("wait_seconds"),
                "round/merge_s": record.get("merge_seconds"),
                **pace,
                **requests,
            },
        )
        for rank, why in sorted(rejected.items()):  # every rejection, with rank and reason
            self.writer.log(
                "event", step=step, round=rnd, event="rejected", rank=int(rank), reason=str(why)
            )
        for key, why in sorted((record.get("objects_refused") or {}).items()):
            self.writer.log(
                "event",
                step=step,
                round=rnd,
                event="rejected",
                rank=-1,
                object=key,
                reason=str(why),
                by=f"rank-{self.rank}",
            )
        if rejected:
            self.writer.status(rejections={"round": rnd, "ranks": rejected})
        if record.get("refused"):  # the committed update was not applied (store_manager.py)
            why = str(record.get("refused"))
            self.writer.log("event", step=step, round=rnd, event="refused", reason=why)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # DiLoCo's callback ran first and loaded the final global weights into the model.
        model = kwargs.get("model")
        step = self._step(state)
        if self.is_evaluator and model is not None:
            if self._last_eval_round != self._round():
                self.evaluate_now(model, step)
            if self.save_final:
                self._status("checkpointing", step, force=True)
                self.checkpoint_now(model, step, name="final")
        self.writer.log("event", step=step, round=self._round(), event="train_end")
        self._status("done", step)
        self.writer.flush()
