"""Memory-bounded token-mean of a per-token vocabulary divergence.

A naive full-vocab divergence at B=1, T=1024, V=151936 keeps half a dozen ``(B, T, V)`` float32
intermediates alive for backward (log-softmaxes, mixture, per-element KL terms): about 7.7 GB.
Here the tokens are processed in chunks of ``chunk_size`` rows. For each chunk we build a small
autograd graph, take its gradient at once and write it into one ``(B, T, V)`` gradient buffer;
the graph is then freed. The buffer is the same tensor backward has to return anyway, so the
peak is one ``B*T*V`` copy plus one chunk's temporaries, and no work is repeated in backward
(backward only scales the buffer by the incoming scalar gradient).

Consequence: the autograd node can be back-propagated through once (the buffer is handed over,
not copied); a second backward through the same graph raises a clear ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# per-token function: (student (n, V), teacher (n, V)) -> (loss (n,), {stat name: (n,) tensor})
PerTokenFn = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]

DEFAULT_CHUNK_SIZE = 256


def _row_ranges(mask: Tensor, chunk_size: int) -> list[tuple[int, Tensor | slice]]:
    """Per batch row b, chunks of selected token positions: a slice when contiguous, else indices."""
    out: list[tuple[int, Tensor | slice]] = []
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().squeeze(-1)
        n = idx.numel()
        if n == 0:
            continue
        first, last = int(idx[0]), int(idx[-1])
        contiguous = last - first + 1 == n  # right-padded completions: one run of real tokens
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            if contiguous:
                out.append((b, slice(first + start, first + stop)))
            else:
                out.append((b, idx[start:stop]))
    return out


def _take(x: Tensor, b: int, sel: Tensor | slice) -> Tensor:
    return x[b, sel] if isinstance(sel, slice) else x[b].index_select(0, sel)


class _ChunkedTokenMean(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        student: Tensor,
        teacher: Tensor,
        mask: Tensor,
        fn: PerTokenFn,
        token_clip: float | None,
        chunk_size: int,
        stats: dict[str, float],
    ) -> Tensor:
        need_grad = bool(ctx.needs_input_grad[0])
        # Low-precision logits are upcast per chunk: the sums over 151k entries need fp32.
        compute_dtype = (
            torch.float32 if student.dtype in (torch.float16, torch.bfloat16) else student.dtype
        )
        n_tokens = int(mask.sum())
        weight = 1.0 / max(n_tokens, 1)
        grad = (
            torch.zeros(student.shape, dtype=student.dtype, device=student.device)
            if need_grad
            else None
        )
        total = torch.zeros((), dtype=compute_dtype, device=student.device)
        sums: dict[str, float] = {}
        clipped = 0
        for b, sel in _row_ranges(mask, chunk_size):
            s_chunk = _take(student, b, sel)
            t_chunk = _take(teacher, b, sel)
            if not bool(torch.isfinite(s_chunk).all()):
                raise ValueError("student_logits contains NaN or Inf at unmasked positions")
            if not bool(torch.isfinite(t_chunk).all()):
                raise ValueError("teacher_logits contains NaN or Inf at unmasked positions")
            s = s_chunk.detach().to(compute_dtype).requires_grad_(need_grad)
            with torch.enable_grad():
                per_token, extra = fn(s, t_chunk.detach().to(compute_dtype))
                if token_clip is not None:
                    clipped += int((per_token.detach() > token_clip).sum())
                    per_token = per_token.clamp(max=token_clip)
                objective = per_token.sum() * weight
            if need_grad and grad is not None:
                (g,) = torch.autograd.grad(objective, s)
                if isinstance(sel, slice):
                    grad[b, sel] = g.to(grad.dtype)
                else:
                    grad[b].index_copy_(0, sel, g.to(grad.dtype))
            total = total + objective.detach()
            for key, stat in extra.items():
                sums[key] = sums.get(key, 0.0) + float(stat.detach().sum())
        stats["tokens"] = float(n_tokens)
        stats["clip_frac"] = clipped / max(n_tokens, 1)
        for key, acc in sums.items():
            stats[key] = acc / max(n_tokens, 1)
        ctx.grad = grad
        return total.to(student.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad = ctx.grad
        if grad is None:
            if ctx.needs_input_grad[0]:
                raise RuntimeError(
                    "chunked distillation loss: backward was called twice through the same graph; "
                    "the gradient buffer is handed over on the first backward (recompute the loss)"
                )
            return (None,) * 7
        ctx.grad = None  # hand the buffer over; holding it would double the peak
        if not bool(grad_output == 1):
            grad.mul_(grad_output.to(grad.dtype))
        return (grad, None, None, None, None, None, None)


def chunked_token_mean(
    student: Tensor,
    teacher: Tensor,
    mask: Tensor,
    fn: PerTokenFn,
    *,
    token_clip: float | None,
    chunk_size: int,
) -> tuple[Tensor, dict[str, float]]:
    """Mean over ``mask`` of ``min(fn(student_row, teacher_row), token_clip)``; ``(B, T, V)`` inputs.

    Rows outside ``mask`` are never read. Returns the loss and the mask-mean of each ``extra``
    statistic of ``fn`` plus ``tokens`` and ``clip_frac``. The teacher gets no gradient.
    """
    stats: dict[str, float] = {}
    loss = _ChunkedTokenMean.apply(
        student, teacher.detach(), mask, fn, token_clip, chunk_size, stats
    )
    return loss, stats
