"""Building the channel-2 and channel-3 inputs of the compose_loss batch contract.

Everything here is per generation batch and runs once per generation, not per micro-step:

* `plan_hints` decides, for every rollout, whether it enters channel 2 and with which hinted
  teacher prompt (failed rollout + a successful sibling from its group and/or its feedback);
* `hint_tensors` tokenises those prompts and appends the rollout's own completion tokens, giving
  ``sdpo_teacher_input_ids`` / ``sdpo_teacher_attention_mask`` (B, L) with the completion in the
  last T positions, plus ``sdpo_sample_mask`` (B,);
* `plan_pairs` picks channel 3's pairs: chosen = the best stored teacher trace for the prompt,
  rejected = the policy's lowest-reward rollout of that prompt in this batch;
* `pair_tensors` stores each pair on its rejected rollout's row (``replay_pair_mask`` (B,),
  ``replay_chosen_ids`` / ``replay_chosen_mask`` (B, Tc)), so TRL's shuffle-and-split of the
  generation batch into micro-batches keeps every pair with its rollout.

Row ``i`` of the local batch is global sample ``process_start + i``; group ``g // G`` holds the
``G = num_generations`` rollouts of one prompt (TRL's RepeatSampler layout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import torch

from composer_replication.data.hints import HintTemplate
from composer_replication.data.traces import Prompt, TraceRecord, TraceStore, prompt_key


class GenerationBatch(TypedDict):
    """TRL's generation batch (``GRPOTrainer._generate_and_score_completions``) as this trainer
    reads it, with the channel-2/3 keys it adds (docs/api.md); TRL's other keys (old log-probs,
    ...) pass through untouched, and ``advantages`` too except on hinted examples (`hint_grpo`).
    A micro-batch of TRL's split has the same keys."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    sdpo_teacher_input_ids: NotRequired[torch.Tensor]
    sdpo_teacher_attention_mask: NotRequired[torch.Tensor]
    sdpo_sample_mask: NotRequired[torch.Tensor]
    sdpo_num_tokens: NotRequired[torch.Tensor]
    replay_pair_mask: NotRequired[torch.Tensor]
    replay_chosen_ids: NotRequired[torch.Tensor]
    replay_chosen_mask: NotRequired[torch.Tensor]
    replay_ref_chosen_logps: NotRequired[torch.Tensor]
    replay_ref_rejected_logps: NotRequired[torch.Tensor]
    replay_num_pairs: NotRequired[torch.Tensor]


def completion_text(completion: object) -> str:
    """Text of a TRL completion (a string, or a list of chat messages for conversational data)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        parts = []
        for message in completion:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(str(content or ""))
        return "".join(parts)
    return str(completion)


@dataclass
class HintPlan:
    """Channel-2 decision per local rollout."""

    teacher_prompts: list[Prompt]
    sample_mask: list[bool]
    with_sibling: int = 0
    with_feedback: int = 0
    failed: int = 0


def plan_hints(
    prompts: Sequence[Prompt],
    all_completions: Sequence[str],
    all_rewards: Sequence[float],
    feedback: Sequence[str | None],
    *,
    num_generations: int,
    process_start: int,
    template: HintTemplate,
    success_threshold: float,
) -> HintPlan:
    """Which local rollouts get a hinted teacher context, and what it says.

    A rollout enters channel 2 when it failed (reward < ``success_threshold``; NaN rewards are
    unscorable and never enter) and it has a successful sibling (another rollout of the same group
    with reward >= threshold; the highest-reward one, earliest on ties) or non-empty feedback
    (shown beside the sibling's solution unless the template's ``feedback_with_solution`` is
    False; without a successful sibling, only if its ``feedback_alone`` is True). Excluded rows
    keep their plain prompt as teacher prompt (masked out later).
    """
    n = len(prompts)
    if len(feedback) != n:
        raise ValueError(f"feedback has {len(feedback)} entries for {n} prompts")
    plan = HintPlan(teacher_prompts=list(prompts), sample_mask=[False] * n)
    for i in range(n):
        g = process_start + i
        reward = float(all_rewards[g])
        if math.isnan(reward) or reward >= success_threshold:
            continue
        plan.failed += 1
        start = (g // num_generations) * num_generations
        best: int | None = None
        for j in range(start, start + num_generations):
            r = float(all_rewards[j])
            if j == g or math.isnan(r) or r < success_threshold:
                continue
            if best is None or r > float(all_rewards[best]):
                best = j
        fb = feedback[i]
        if fb is not None and not fb.strip():
            fb = None
        sibling = completion_text(all_completions[best]) if best is not None else None
        if sibling is not None and not sibling.strip():
            sibling = None
        if sibling is not None and not template.feedback_with_solution:
            fb = None  # the solution alone (SDPO's environment_feedback_only_without_solution)
        if sibling is None and not template.feedback_alone:
            fb = None  # no successful sibling, no hint: distil only from successful ones
        if sibling is None and fb is None:
            continue
        plan.sample_mask[i] = True
        plan.with_sibling += sibling is not None
        plan.with_feedback += fb is not None
        plan.teacher_prompts[i] = template.render(prompts[i], sibling, fb)
    return plan


def select_probe_rows(
    sample_mask: Sequence[bool], process_start: int, num_generations: int, limit: int
) -> list[int]:
    """Up to ``limit`` local rows of ``sample_mask`` (the hinted ones) whose teacher is probed:
    the first hinted row of each prompt group in order, then further hinted rows in order."""
    if limit <= 0:
        return []
    hinted = [i for i, on in enumerate(sample_mask) if on]
    seen: set[int] = set()
    first: list[int] = []
    rest: list[int] = []
    for i in hinted:
        group = (process_start + i) // num_generations
        (rest if group in seen else first).append(i)
        seen.add(group)
    return sorted((first + rest)[:limit])


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, left-padded (prompts)."""
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, right-padded (completions)."""
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, : len(r)] = 1
    return ids, mask


def hint_tensors(
    plan: HintPlan,
    tokenize_prompts: Callable[[list[Prompt]], list[list[int]]],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """Teacher inputs per the batch contract: [left pad][hinted context][the same completion].

    Whole contexts: the loss library applies ``sdpo_max_context_length`` (cut from the middle).
    """
    contexts = [list(ids) for ids in tokenize_prompts(plan.teacher_prompts)]
    ctx_ids, ctx_mask = left_pad(contexts, pad_id)
    device = completion_ids.device
    return {
        "sdpo_teacher_input_ids": torch.cat([ctx_ids.to(device), completion_ids], dim=1),
        "sdpo_teacher_attention_mask": torch.cat(
            [ctx_mask.to(device), completion_mask.long()], dim=1
        ),
        "sdpo_sample_mask": torch.tensor(plan.sample_mask, dtype=torch.bool, device=device),
    }


@dataclass(frozen=True)
class Pair:
    """One channel-3 pair: the trace (chosen) and the local row of the rejected rollout."""

    row: int
    trace: TraceRecord
    rejected_reward: float


def plan_pairs(
    prompts: Sequence[Prompt],
    rewards: Sequence[float],
    completion_lengths: Sequence[int],
    store: TraceStore,
    *,
    num_generations: int,
    process_start: int,
    skip_if_not_worse: bool = True,
    min_trace_reward: float | None = None,
) -> tuple[list[Pair], int]:
    """Pairs for the local rows, and how many local prompt groups had a trace at all.

    For each prompt group present locally: chosen = ``store.best(prompt_key(prompt))``; rejected
    = the local rollout with the lowest reward (earliest on ties; unscorable NaN rewards and empty
    completions are never picked). With ``skip_if_not_worse`` a pair is dropped when the trace has
    a reward and the rejected rollout scored at least as much (nothing to prefer). With
    ``min_trace_reward`` a trace scored below it, or not scored at all, is never replayed (a
    teacher the verifier rejects is not a target; rejection-sampling fine-tuning's filter).
    """
    groups: dict[int, list[int]] = {}
    for i in range(len(prompts)):
        groups.setdefault((process_start + i) // num_generations, []).append(i)
    pairs: list[Pair] = []
    covered = 0
    for rows in groups.values():
        trace = store.best(prompt_key(prompts[rows[0]]))
        if trace is None:
            continue
        if min_trace_reward is not None and (
            trace.reward is None or trace.reward < min_trace_reward
        ):
            continue
        covered += 1
        candidates = [
            i for i in rows if completion_lengths[i] > 0 and not math.isnan(float(rewards[i]))
        ]
        if not candidates:
            continue
        worst = min(candidates, key=lambda i: (float(rewards[i]), i))
        r = float(rewards[worst])
        if skip_if_not_worse and trace.reward is not None and r >= trace.reward:
            continue
        pairs.append(Pair(row=worst, trace=trace, rejected_reward=r))
    return pairs, covered


def pair_tensors(
    pairs: Sequence[Pair],
    batch_size: int,
    tokenize_text: Callable[[str], list[int]],
    *,
    pad_id: int,
    eos_id: int | None,
    max_length: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Chosen completions stored on their rejected rollout's row (see module docstring).

    The trace text is tokenised without special tokens, gets ``eos_id`` appended (the trainer
    passes the chat template's end-of-turn token, else EOS: so the policy also learns to stop) and is cut to ``max_length`` tokens.
    """
    if max_length < 1:
        raise ValueError("replay max length must be >= 1")
    rows: list[list[int]] = [[] for _ in range(batch_size)]
    mask = torch.zeros(batch_size, dtype=torch.bool)
    for pair in pairs:
        ids = list(tokenize_text(pair.trace.completion))
        if eos_id is not None:
            ids.append(eos_id)
        rows[pair.row] = ids[:max_length]
        mask[pair.row] = True
    chosen_ids, chosen_mask = right_pad(rows, pad_id)
    return {
        "replay_pair_mask": mask.to(device),
        "replay_chosen_ids": chosen_ids.to(device),
        "replay_chosen_mask": chosen_mask.to(device),
    }
