"""`HFModelTeacher`: a local Hugging Face causal LM used as a teacher (``model.generate``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_replication.data.teachers.base import (
    Prompt,
    TeacherCompletion,
    as_messages,
)


class HFModelTeacher:
    """Generates with a local model: chat template, left padding, batches of ``batch_size``.

    Greedy by default (``temperature=0``) so baked traces are reproducible; token counts are
    reported, cost is 0.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        batch_size: int = 8,
    ) -> None:
        if max_new_tokens <= 0 or batch_size <= 0:
            raise ValueError("max_new_tokens and batch_size must be positive")
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or str(getattr(model.config, "_name_or_path", "") or "hf-model")
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size

    def _texts(self, prompts: Sequence[Prompt]) -> list[str]:
        if getattr(self.tokenizer, "chat_template", None):
            return [
                self.tokenizer.apply_chat_template(
                    as_messages(p), tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        return [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in prompts]

    def complete(self, prompts: Sequence[Prompt]) -> list[TeacherCompletion]:
        import torch

        out: list[TeacherCompletion] = []
        texts = self._texts(prompts)
        device = next(self.model.parameters()).device
        old_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"  # generation appends on the right
        try:
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                enc = self.tokenizer(
                    chunk, return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                gen_kwargs: dict[str, int | float | bool | None] = {
                    "max_new_tokens": self.max_new_tokens,
                    "pad_token_id": self.tokenizer.pad_token_id,
                    "do_sample": self.temperature > 0,
                }
                if self.temperature > 0:
                    gen_kwargs["temperature"] = self.temperature
                with torch.no_grad():
                    ids = self.model.generate(**enc, **gen_kwargs)
                new = ids[:, enc["input_ids"].shape[1] :]
                for row, prompt_mask in zip(new, enc["attention_mask"]):
                    text = self.tokenizer.decode(row, skip_special_tokens=True)
                    n_new = int((row != self.tokenizer.pad_token_id).sum())
                    out.append(
                        TeacherCompletion(
                            text=text,
                            prompt_tokens=int(prompt_mask.sum()),
                            completion_tokens=n_new,
                        )
                    )
        finally:
            self.tokenizer.padding_side = old_side
        return out
