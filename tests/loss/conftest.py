"""Shared fixtures for the loss tests: a tiny causal LM and a full three-channel batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch


class LinearLM(torch.nn.Module):
    """A deterministic toy causal LM: embedding + one position-mixing layer + head.

    Cheap (milliseconds) and differentiable; enough to test what compose_loss does with the
    forward passes. The transformers-based tiny model is used in one end-to-end test.
    """

    def __init__(self, vocab: int = 11, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.head = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g))
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        self.calls.append((tuple(input_ids.shape), torch.is_grad_enabled()))
        h = self.emb[input_ids] * attention_mask.unsqueeze(-1).to(self.emb.dtype)
        # causal running mean over positions so each position sees its prefix
        csum = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        h = torch.tanh(h + csum @ self.mix)

        class Out:
            logits = h @ self.head

        return Out()


def make_batch(
    vocab: int = 11,
    B: int = 3,
    P: int = 4,
    T: int = 5,
    L: int = 9,
    N: int = 2,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A batch following docs/api.md (channels 1-3), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(0, vocab, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        completion_mask[b, T - b :] = 0  # right padding of varying length
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, 0] = 0  # left padding
    batch: dict[str, torch.Tensor] = {
        "prompt_ids": torch.randint(0, vocab, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "sdpo_teacher_input_ids": torch.cat(
            [torch.randint(0, vocab, (B, L - T), generator=g), completion_ids], 1
        ),
        "sdpo_teacher_attention_mask": torch.ones(B, L, dtype=torch.long),
        "sdpo_sample_mask": torch.tensor([True, False, True][:B] + [True] * max(0, B - 3)),
        "replay_ref_chosen_logps": -torch.rand(N, generator=g) * 10,
        "replay_ref_rejected_logps": -torch.rand(N, generator=g) * 10,
    }
    for side, length in (("chosen", 7), ("rejected", 6)):
        loss_mask = torch.zeros(N, length, dtype=torch.long)
        loss_mask[:, 3:] = 1
        batch[f"replay_{side}_input_ids"] = torch.randint(0, vocab, (N, length), generator=g)
        batch[f"replay_{side}_attention_mask"] = torch.ones(N, length, dtype=torch.long)
        batch[f"replay_{side}_loss_mask"] = loss_mask
    return batch


@pytest.fixture(autouse=True)
def _single_thread() -> Any:
    """Run the loss tests on one intra-op thread.

    The tensors here are tiny; with 2 OpenMP threads every kernel opens a parallel region that
    must wait for a second core, which on a loaded machine costs milliseconds per op (seen: 20 ms
    per log_softmax of a 3x6 tensor). The previous setting is restored afterwards.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lm() -> LinearLM:
    return LinearLM()


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    return make_batch()


@pytest.fixture
def make_batch_fn() -> Any:
    return make_batch


@pytest.fixture
def make_lm() -> Any:
    return LinearLM
