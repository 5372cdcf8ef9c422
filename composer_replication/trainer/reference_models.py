"""Reference models: TRL's KL reference for in-memory models, and channel 3's DPO reference.

TRL 1.16 builds its KL reference (``beta != 0``) by reloading ``config._name_or_path``, which fails
for a model that only exists in memory (and silently diverges from it if the in-memory weights
were changed after loading). `reference_from_memory` makes TRL use a frozen deep copy instead.

`ReferenceScorer` computes channel 3's summed reference log-probs per pair: from a frozen model,
or, for PEFT policies, from the policy with its adapters disabled. The chosen side is a fixed
trace, so its value is cached per (prompt key, teacher, text, length) unless the reference
itself moves (``sync_ref_model``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from composer_replication.loss import completion_logps
from composer_replication.trainer.batch import GenerationBatch, Pair
from composer_replication.trainer.ema import frozen_copy

if TYPE_CHECKING:
    from peft import PeftModel


def is_peft(model: object) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextlib.contextmanager
def reference_from_memory(model: str | nn.Module, beta: float) -> Iterator[None]:
    """While TRL builds its KL reference model, build it as a frozen copy of ``model``."""
    if isinstance(model, str) or beta == 0.0 or is_peft(model):
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.create_model_from_path

    def from_memory(model_id: str, **kwargs: object) -> nn.Module:
        ref = frozen_copy(model)
        dtype = kwargs.get("dtype")
        return ref.to(dtype) if isinstance(dtype, torch.dtype) else ref

    grpo_module.create_model_from_path = from_memory  # type: ignore[assignment]
    try:
        yield
    finally:
        grpo_module.create_model_from_path = original


class ReferenceScorer:
    """Summed reference log-probs of channel-3 pairs (no gradient)."""

    def __init__(
        self,
        ref_model: nn.Module | None,
        *,
        policy: nn.Module,
        unwrap: Callable[[nn.Module], nn.Module],
        cacheable: bool = True,
    ) -> None:
        self.ref_model = ref_model
        self.policy = policy
        self.unwrap = unwrap
        self.cacheable = cacheable
        self.cache: dict[tuple[str, str, str, int], float] = {}

    def state_rows(self) -> list[list[str | int | float]]:
        """The cache as JSON rows ``[prompt_key, teacher, text, length, logp]`` (exact resume:
        a value recomputed in another batch may differ in its last bits)."""
        return [[*key, value] for key, value in self.cache.items()]

    def load_state_rows(self, rows: Sequence[Any]) -> None:
        """Restore `state_rows`' output (ValueError on a malformed or non-finite row)."""
        cache: dict[tuple[str, str, str, int], float] = {}
        for i, row in enumerate(rows):
            ok = isinstance(row, list | tuple) and len(row) == 5
            if ok:
                key, teacher, text, length, value = row
                ok = (
                    all(isinstance(x, str) for x in (key, teacher, text))
                    and isinstance(length, int)
                    and isinstance(value, int | float)
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                )
            if not ok:
                raise ValueError(f"reference cache row {i} is malformed: {str(row)[:80]}")
            cache[(key, teacher, text, length)] = float(value)
        self.cache = cache

    @contextlib.contextmanager
    def _model(self) -> Iterator[nn.Module]:
        if self.ref_model is not None:
            yield self.ref_model
            return
        peft = cast("PeftModel", self.unwrap(self.policy))  # PEFT (`is_peft`): without a ref_model
        with peft.disable_adapter():  # PEFT: the base model is the reference
            yield self.policy

    @torch.no_grad()
    def pair_logps(
        self, output: GenerationBatch, tensors: dict[str, torch.Tensor], pairs: Sequence[Pair]
    ) -> dict[str, torch.Tensor]:
        """``replay_ref_chosen_logps`` / ``replay_ref_rejected_logps`` (B,), 0 on unpaired rows."""
        batch = output["completion_ids"].shape[0]
        device = output["completion_ids"].device
        ref_c = torch.zeros(batch, device=device)
        ref_r = torch.zeros(batch, device=device)
        if not pairs:
            return {"replay_ref_chosen_logps": ref_c, "replay_ref_rejected_logps": ref_r}
        rows = torch.tensor([p.row for p in pairs], device=device)
        p_ids = output["prompt_ids"].index_select(0, rows)
        p_mask = output["prompt_mask"].index_select(0, rows)
        r_ids = output["completion_ids"].index_select(0, rows)
        r_mask = output["completion_mask"].index_select(0, rows)
        c_ids = tensors["replay_chosen_ids"].index_select(0, rows)
        c_mask = tensors["replay_chosen_mask"].index_select(0, rows)
        keys = [
            (p.trace.prompt_key, p.trace.teacher, p.trace.completion, int(c_mask[i].sum()))
            for i, p in enumerate(pairs)
        ]
        with self._model() as ref:
            r_sum, _ = completion_logps(ref, p_ids, p_mask, r_ids, r_mask, logits_to_keep=True)
            ref_r[rows] = r_sum.to(ref_r.dtype)
            todo = [i for i, k in enumerate(keys) if not self.cacheable or k not in self.cache]
            if todo:
                idx = torch.tensor(todo, device=device)
                c_sum, _ = completion_logps(
                    ref, p_ids[idx], p_mask[idx], c_ids[idx], c_mask[idx], logits_to_keep=True
                )
                values = c_sum.tolist()
                for i, v in zip(todo, values):
                    self.cache[keys[i]] = v
        for i, p in enumerate(pairs):
            ref_c[p.row] = self.cache[keys[i]]
        if not self.cacheable:
            self.cache.clear()
        return {"replay_ref_chosen_logps": ref_c, "replay_ref_rejected_logps": ref_r}
