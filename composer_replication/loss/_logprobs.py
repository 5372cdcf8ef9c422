"""Per-token log-probs of chosen tokens without materialising a ``(B, T, V)`` log-softmax.

``log p(y) = z_y / temp - logsumexp(z / temp)``. Autograd through ``log_softmax`` (or through
``logits / temp`` followed by ``logsumexp``) would keep a full-vocab copy alive until backward.
This function keeps only the ``(B, T)`` logsumexp and rebuilds ``softmax`` row-chunk by
row-chunk in backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from composer_replication.loss._parallel import auto_chunk_size, ordered_map


def _blocks(B: int, T: int, rows: int) -> list[tuple[int, int]]:
    """(batch row, first token) of each block of ``rows`` tokens."""
    return [(b, s) for b in range(B) for s in range(0, T, rows)]


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, index: Tensor, temperature: float) -> Tensor:  # type: ignore[override]
        compute_dtype = (
            torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        )
        B, T, V = logits.shape
        rows = auto_chunk_size(V)  # blocks of about 1M logits run on the loss worker threads
        lse = torch.empty((B, T), dtype=compute_dtype, device=logits.device)

        def forward_block(block: tuple[int, int]) -> None:
            b, s = block
            chunk = logits[b, s : s + rows].to(compute_dtype) / temperature
            lse[b, s : s + rows] = torch.logsumexp(chunk, -1)

        ordered_map(forward_block, _blocks(B, T, rows))
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).to(compute_dtype) / temperature
        ctx.save_for_backward(logits, index, lse)
        ctx.temperature = temperature
        # Returned in the compute dtype (fp32 for bf16 logits): log-probs feed exp(ratio) and sums.
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        logits, index, lse = ctx.saved_tensors
        temp = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        B, T, V = logits.shape
        rows = auto_chunk_size(V)

        def backward_block(block: tuple[int, int]) -> None:
            b, s = block
            chunk = logits[b, s : s + rows].to(lse.dtype) / temp
            g = grad_out[b, s : s + rows].to(lse.dtype).unsqueeze(-1)
            # d/dz [z_y/temp - lse(z/temp)] = (onehot(y) - softmax(z/temp)) / temp
            gz = torch.exp(chunk - lse[b, s : s + rows].unsqueeze(-1)).mul_(-g)
            gz.scatter_add_(-1, index[b, s : s + rows].unsqueeze(-1), g)
            grad[b, s : s + rows] = gz.div_(temp)

        ordered_map(backward_block, _blocks(B, T, rows))
        return grad, None, None


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0) -> Tensor:
    """``(B, T, V)`` logits, ``(B, T)`` token ids -> ``(B, T)`` log-probs of those ids.

    Logits are divided by ``temperature`` first (TRL's sampling temperature).
    """
    if logits.dim() != 3 or index.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (B, T, V) and index (B, T); got {tuple(logits.shape)} and {tuple(index.shape)}"
        )
    result: Tensor = _SelectiveLogSoftmax.apply(logits, index.long(), float(temperature))
    return result
