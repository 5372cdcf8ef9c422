"""Memory-bounded token-mean of a per-token vocabulary divergence.

A naive full-vocab divergence at B=1, T=1024, V=151936 keeps about a dozen ``(B, T, V)`` float32
intermediates alive for backward (log-softmaxes, mixture, stacked terms, per-element KL): ~7.5 GB.
Here the tokens are processed in chunks of ``chunk_size`` rows (default: about 1M logits). For
each chunk a kernel returns the per-token losses and their gradient rows (in closed form for the
full-vocabulary divergences, by a small per-chunk autograd graph for top-k), written at once into
one ``(B, T, V)`` gradient buffer; the chunk's temporaries are then freed. Backward only scales
that buffer by the incoming scalar gradient, so no work is repeated and nothing is recomputed.

Peak: the buffer (the gradient itself: the floor) plus one chunk's temporaries per worker thread.
Backward hands the scaled buffer on:

- in place when the running backward pass does not keep the graph (``retain_graph`` false, the
  default of ``loss.backward()`` and ``torch.autograd.grad``). The buffer is then consumed: the
  context drops its reference first, so autograd can keep the very buffer as ``.grad`` with no
  copy, and a second backward through the same graph raises the usual "backward through the
  graph a second time" error instead of reading a scaled buffer;
- as a new tensor (one more buffer) when the graph is kept (``retain_graph=True``, gradcheck):
  the buffer stays intact, so every pass gets the same gradient.

Whether the pass keeps the graph is the autograd engine's own flag for the running graph task
(``torch._C._autograd._get_current_graph_task_keep_graph``, the flag torch's AOTAutograd reads to
free saved tensors used once). If a torch build lacks it, every backward takes the copy (correct,
one more buffer). The closed-form gradient has no graph of its own, so a backward with
``create_graph=True`` raises a clear error instead of returning a gradient whose own derivative
would silently miss this loss's second-order term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from composer_replication.loss._parallel import auto_chunk_size, ordered_map

# Per-token function for autograd kernels:
#   (student (n, V), teacher (n, V)) -> (loss (n,), {stat name: (n,) tensor})
PerTokenFn = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]
# A chunk kernel: (student (n, V), teacher (n, V), need_grad) ->
#   (loss (n,), d loss_i / d student_i as (n, V) or None, {stat name: (n,) tensor}).
# Row i of the gradient depends only on token i, so kernels may compute it in closed form.
Kernel = Callable[[Tensor, Tensor, bool], tuple[Tensor, Tensor | None, dict[str, Tensor]]]


# The engine's "keep the graph" flag of the running backward pass; True outside one. Absent in a
# torch build, every backward is treated as keeping the graph (the copy: correct, not minimal).
_keep_graph_flag: Callable[[], bool] | None = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", None
)

_SECOND_BACKWARD = (
    "Trying to backward through the graph a second time: the distillation loss's gradient "
    "buffer was consumed in place by the first backward, which did not retain the graph. "
    "Specify retain_graph=True on every backward call but the last (or recompute the loss)."
)

_CREATE_GRAPH = (
    "create_graph=True is not supported through the chunked distillation losses "
    "(generalized_jsd, taid_loss, entropy_opd_loss): their gradient is computed in closed form "
    "during forward and has no graph, so its own derivative would silently miss this loss's "
    "second-order term. Take this loss's gradient in a backward without create_graph."
)


def graph_retained() -> bool:
    """Whether the running backward pass keeps the graph (True outside backward or if unknown)."""
    return True if _keep_graph_flag is None else bool(_keep_graph_flag())


def autograd_kernel(fn: PerTokenFn) -> Kernel:
    """Turn a differentiable per-token function into a kernel (gradient by autograd per chunk)."""

    def kernel(
        s: Tensor, t: Tensor, need_grad: bool
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        s = s.detach().requires_grad_(need_grad)
        with torch.enable_grad():  # autograd.Function.forward runs with grad mode off
            per_token, extra = fn(s, t)
            grad = torch.autograd.grad(per_token.sum(), s)[0] if need_grad else None
        return per_token.detach(), grad, {k: v.detach() for k, v in extra.items()}

    return kernel


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


class _Ctx(Protocol):
    """What the chunked losses keep on autograd's context object."""

    needs_input_grad: tuple[bool, ...]
    grad: Tensor | None
    consumed: bool


class _ChunkedTokenMean(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx,
        student: Tensor,
        teacher: Tensor,
        mask: Tensor,
        kernel: Kernel,
        token_clip: float | None,
        chunk_size: int,
        stats: dict[str, float],
        grad_enabled: bool,
    ) -> Tensor:
        # needs_input_grad is True even under torch.no_grad(); grad_enabled (the caller's grad
        # mode) keeps evaluation passes from building a gradient nobody will read.
        need_grad = grad_enabled and bool(ctx.needs_input_grad[0])
        # Low-precision logits are upcast per chunk: the sums over 151k entries need fp32.
        low_precision = student.dtype in (torch.float16, torch.bfloat16)
        compute_dtype = torch.float32 if low_precision else student.dtype
        n_tokens = int(mask.sum())
        weight = 1.0 / max(n_tokens, 1)
        grad: Tensor | None = None
        if need_grad:
            # Rows outside the mask get no gradient; when every row is written, skip the zero fill.
            alloc = torch.empty if bool(mask.all()) else torch.zeros
            grad = alloc(student.shape, dtype=student.dtype, device=student.device)

        def process(chunk: tuple[int, Tensor | slice]) -> tuple[float, int, dict[str, float]]:
            """Loss sum, clipped count and stat sums of one chunk; writes its gradient rows."""
            b, sel = chunk
            s = _take(student, b, sel).detach().to(compute_dtype)
            t = _take(teacher, b, sel).detach().to(compute_dtype)
            # One reduction per input instead of an isfinite mask: a sum is finite iff every
            # element is (NaN and +-inf propagate; overflow would need |logits| ~ 1e33).
            for name, x in (("student_logits", s), ("teacher_logits", t)):
                if not bool(torch.isfinite(x.sum())):
                    raise ValueError(f"{name} contains NaN or Inf at unmasked positions")
            per_token, g, extra = kernel(s, t, need_grad)
            scale = torch.full_like(per_token, weight)
            n_clipped = 0
            if token_clip is not None:
                over = per_token > token_clip
                n_clipped = int(over.sum())
                per_token = per_token.clamp(max=token_clip)
                scale = scale.masked_fill(over, 0.0)  # a clipped token is constant: no gradient
            if grad is not None and g is not None:
                g.mul_(scale.unsqueeze(-1))
                if isinstance(sel, slice):
                    grad[b, sel] = g
                else:
                    grad[b].index_copy_(0, sel, g.to(grad.dtype))
            # Only python scalars leave the chunk: nothing chunk-sized stays alive.
            stat_sums = {key: float(stat.sum()) for key, stat in extra.items()}
            return float(per_token.double().sum()), n_clipped, stat_sums

        total = 0.0
        sums: dict[str, float] = {}
        clipped = 0
        # Chunks write disjoint gradient rows; sums are reduced here in chunk order, so the
        # result does not depend on thread scheduling.
        for part, n_clipped, stat_sums in ordered_map(process, _row_ranges(mask, chunk_size)):
            total += part
            clipped += n_clipped
            for key, value in stat_sums.items():
                sums[key] = sums.get(key, 0.0) + value
        stats["tokens"] = float(n_tokens)
        stats["clip_frac"] = clipped / max(n_tokens, 1)
        for key, acc in sums.items():
            stats[key] = acc / max(n_tokens, 1)
        ctx.grad = grad
        ctx.consumed = False
        # fp32 for bf16/fp16 logits: the loss value is a sum over many tokens.
        return torch.tensor(total * weight, dtype=compute_dtype, device=student.device)

    @staticmethod
    def backward(ctx: _Ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.consumed:
            raise RuntimeError(_SECOND_BACKWARD)
        if torch.is_grad_enabled():  # backward runs with grad mode on only for create_graph=True
            raise RuntimeError(_CREATE_GRAPH)
        grad: Tensor | None = ctx.grad
        if grad is None:
            return (None,) * 8
        scale = grad_output.to(grad.dtype)
        if graph_retained():
            # The graph may be back-propagated again: leave the buffer as forward wrote it.
            return (grad * scale, None, None, None, None, None, None, None)
        # Last use: drop the context's reference so autograd can keep the buffer itself as .grad
        # (it copies a gradient that something else still references), then scale it in place.
        ctx.grad = None
        ctx.consumed = True
        return (grad.mul_(scale), None, None, None, None, None, None, None)


def chunked_token_mean(
    student: Tensor,
    teacher: Tensor,
    mask: Tensor,
    kernel: Kernel,
    *,
    token_clip: float | None,
    chunk_size: int | None,
) -> tuple[Tensor, dict[str, float]]:
    """Mean over ``mask`` of ``min(kernel(student_row, teacher_row), token_clip)``.

    ``student``/``teacher`` are ``(B, T, V)``, ``mask`` ``(B, T)`` bool. Rows outside ``mask`` are
    never read. Returns the loss and the mask-mean of each ``extra`` statistic of the kernel plus
    ``tokens`` and ``clip_frac``. The teacher gets no gradient.
    """
    stats: dict[str, float] = {}
    rows = auto_chunk_size(student.shape[-1]) if chunk_size is None else chunk_size
    loss: Tensor = _ChunkedTokenMean.apply(  # type: ignore[no-untyped-call]
        student, teacher.detach(), mask, kernel, token_clip, rows, stats, torch.is_grad_enabled()
    )
    return loss, stats
