"""Channels 2 and 3 fused with the output layer: losses from last hidden states.

Channel 3 (``fused_linear_logps``): the log-probs of given tokens, ``log_softmax((h W^T + b) /
tau)[y]``, equal to ``selective_log_softmax(h @ W.T + b, y, tau)`` without the ``(B, T, V)``
logits: forward keeps one ``(N,)`` log-sum-exp per token (an online log-sum-exp over vocabulary
tiles, ``_fused_math.linear_logps``); backward recomputes the tiles and multiplies the logits'
gradient ``g (onehot(y) - softmax)`` back through the output layer tile by tile
(``_fused_math.linear_logps_backward``), with the same tile machinery as channel 2 (chunk sizes,
float32 logits for low-precision inputs, ``GradAccumulator``). Its upstream gradient is a
per-token vector (DPO / SimPO / the NLL term weight each token's log-prob), so unlike the JSD
below the gradient cannot be formed during forward: the tiles' matmuls run once more in backward,
which costs compute, never memory. Backward may run more than once (``retain_graph``): nothing
is consumed.

Channel 2 (``fused_linear_jsd``): generalized JSD from last hidden states.

``fused_linear_jsd(student_hidden, teacher_hidden, weight, bias, ...)`` equals
``distill.generalized_jsd(student_hidden @ weight.T + bias, teacher_hidden @ teacher_weight.T +
teacher_bias, ...)`` (same beta / temperature / mask / token-clip conventions, same metrics) but
never builds the ``(B, T, V)`` logits of either side: the vocabulary and the tokens are processed
in ``(tokens x vocabulary)`` tiles with an online log-sum-exp, and the gradients for the student's
hidden states, the output weight and the bias are computed during forward in closed form
(``_fused_math``). Memory: the gradients themselves plus a few tiles. The teacher side never gets
a gradient (the teacher may share the student's weight: a tied or the same model).

Backends (``backend=``; ``_fused_backends``): ``"auto"`` (the default: our Triton kernels on a
CUDA device when Triton is installed, else PyTorch), ``"torch"``, ``"triton"``, ``"liger"``
(Liger-Kernel's ``LigerFusedLinearJSD``, no bias or token clip). All give the same values up to
float rounding.

Backward scales the gradients by the incoming scalar, in place when the running backward pass
does not keep the graph (as ``_chunked``: the buffers become ``.grad`` without a copy), as new
tensors when it does; ``create_graph=True`` raises.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from composer_replication.loss._checks import as_bool_mask, check_scalar, check_tensor
from composer_replication.loss._chunked import _CREATE_GRAPH, _SECOND_BACKWARD, graph_retained
from composer_replication.loss._fused_backends import FUSED_JSD_BACKENDS, select_backend
from composer_replication.loss._fused_math import (
    FusedProblem,
    LogpsProblem,
    linear_logps,
    linear_logps_backward,
)

__all__ = ["FUSED_JSD_BACKENDS", "fused_linear_jsd", "fused_linear_logps"]


def _check_chunk(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None (auto), got {value!r}")
    return value


def _check_inputs(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
) -> None:
    check_tensor("student_hidden", student_hidden, ndim=3)
    check_tensor("teacher_hidden", teacher_hidden, ndim=3)
    check_tensor("weight", weight, ndim=2)
    check_tensor("teacher_weight", teacher_weight, ndim=2)
    for name, x in (
        ("student_hidden", student_hidden),
        ("teacher_hidden", teacher_hidden),
        ("weight", weight),
        ("teacher_weight", teacher_weight),
    ):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if teacher_hidden.shape[:2] != student_hidden.shape[:2]:
        raise ValueError(
            f"teacher_hidden has shape {tuple(teacher_hidden.shape)} but student_hidden has "
            f"{tuple(student_hidden.shape)}; they must share (B, T)"
        )
    if weight.shape[1] != student_hidden.shape[-1]:
        raise ValueError(
            f"weight is (V, H) = {tuple(weight.shape)} but student_hidden has H = "
            f"{student_hidden.shape[-1]}; pass the output layer's weight (lm_head.weight)"
        )
    if teacher_weight.shape[1] != teacher_hidden.shape[-1]:
        raise ValueError(
            f"teacher_weight is (V, H) = {tuple(teacher_weight.shape)} but teacher_hidden has "
            f"H = {teacher_hidden.shape[-1]}"
        )
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"vocab mismatch: weight has V={weight.shape[0]} but teacher_weight has "
            f"V={teacher_weight.shape[0]}; student and teacher must share one vocabulary"
        )
    for name, b in (("bias", bias), ("teacher_bias", teacher_bias)):
        if b is not None and (not isinstance(b, Tensor) or b.shape != (weight.shape[0],)):
            shape = tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__
            raise ValueError(
                f"{name} must be None or a (V,) = ({weight.shape[0]},) tensor, got {shape}"
            )
    devices = {x.device for x in (student_hidden, teacher_hidden, weight, teacher_weight)}
    if len(devices) != 1:
        raise ValueError(f"the hidden states and weights must be on one device, got {devices}")


def _rows(x: Tensor, index: Tensor | None) -> Tensor:
    flat = x.detach().reshape(-1, x.shape[-1])
    return flat if index is None else flat.index_select(0, index)


def _check_finite(name: str, x: Tensor) -> None:
    # A sum is finite iff every element is (NaN and +-inf propagate); one reduction, no mask.
    if x.numel() and not bool(torch.isfinite(x.sum(dtype=torch.float32))):
        raise ValueError(f"{name} contains NaN or Inf at unmasked positions")


_Grads = tuple[Tensor | None, Tensor | None, Tensor | None]  # hidden, weight, bias


class _Ctx(Protocol):
    needs_input_grad: tuple[bool, ...]
    grads: _Grads
    consumed: bool


class _FusedLinearJSD(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx,
        student_hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        teacher_bias: Tensor | None,
        mask: Tensor,
        settings: tuple[float, float, float | None, int | None, int | None, str],
        stats: dict[str, float],
        grad_enabled: bool,
    ) -> Tensor:
        beta, temperature, token_clip, token_chunk, vocab_chunk, backend_name = settings
        B, T, H = student_hidden.shape
        index = None if bool(mask.all()) else mask.reshape(-1).nonzero().squeeze(-1)
        hs = _rows(student_hidden, index)
        ht = _rows(teacher_hidden, index)
        _check_finite("student_hidden", hs)
        _check_finite("teacher_hidden", ht)
        problem = FusedProblem(
            hs=hs,
            ht=ht,
            weight=weight.detach(),
            bias=None if bias is None else bias.detach(),
            teacher_weight=teacher_weight.detach(),
            teacher_bias=None if teacher_bias is None else teacher_bias.detach(),
            beta=beta,
            temperature=temperature,
            token_clip=token_clip,
            need_hidden=grad_enabled and bool(ctx.needs_input_grad[0]),
            need_weight=grad_enabled and bool(ctx.needs_input_grad[1]),
            need_bias=grad_enabled and bias is not None and bool(ctx.needs_input_grad[2]),
            token_chunk=token_chunk,
            vocab_chunk=vocab_chunk,
        )
        n_tokens = problem.tokens
        backend = select_backend(problem, backend_name)
        result = backend.run(problem) if n_tokens else None
        grad_hidden = grad_weight = grad_bias = None
        if problem.need_hidden:
            grad_hidden = torch.zeros_like(student_hidden)
            if result is not None and result.grad_hidden is not None:
                rows = result.grad_hidden.to(student_hidden.dtype)
                flat = grad_hidden.view(B * T, H)
                if index is None:
                    flat.copy_(rows)
                else:
                    flat.index_copy_(0, index, rows)
        if problem.need_weight:
            grad_weight = result.grad_weight if result is not None else None
            if grad_weight is None:
                grad_weight = torch.zeros_like(weight)
        if problem.need_bias and bias is not None:
            grad_bias = result.grad_bias if result is not None else None
            if grad_bias is None:
                grad_bias = torch.zeros_like(bias)
        loss_sum = result.loss_sum if result is not None else 0.0
        clipped = result.clipped if result is not None else 0
        stats["tokens"] = float(n_tokens)
        stats["clip_frac"] = clipped / max(n_tokens, 1)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.consumed = False
        out_dtype = problem.compute_dtype
        return torch.tensor(loss_sum / max(n_tokens, 1), dtype=out_dtype, device=weight.device)

    @staticmethod
    def backward(ctx: _Ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.consumed:
            raise RuntimeError(_SECOND_BACKWARD)
        if torch.is_grad_enabled():  # backward runs with grad mode on only for create_graph=True
            raise RuntimeError(_CREATE_GRAPH)
        grads = ctx.grads
        keep = graph_retained()
        if not keep:  # last use: autograd may keep the very buffers as .grad (no copy)
            ctx.grads = (None, None, None)
            ctx.consumed = True
        scaled: list[Tensor | None] = []
        for g in grads:
            if g is None:
                scaled.append(None)
            elif keep:
                scaled.append(g * grad_output.to(g.dtype))
            else:
                scaled.append(g.mul_(grad_output.to(g.dtype)))
        return (scaled[0], scaled[1], scaled[2]) + (None,) * 7


def fused_linear_jsd(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    teacher_weight: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    token_clip: float | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, float]]:
    """Generalized JSD of ``softmax(h_s W^T + b)`` and ``softmax(h_t W_t^T + b_t)``, token-mean.

    Args:
        student_hidden: ``(B, T, H)`` the student's last hidden states (the output layer's
            input), differentiable.
        teacher_hidden: ``(B, T, Ht)`` the teacher's, never differentiated.
        weight: ``(V, H)`` the student's output layer (``lm_head.weight``; tied or not),
            differentiable; ``bias``: ``(V,)`` or None.
        teacher_weight / teacher_bias: the teacher's output layer; default: the student's
            (same model), used without gradient.
        beta, temperature, mask, token_clip: as ``distill.generalized_jsd`` (beta 0 = forward
            KL(teacher || student), 1 = reverse; logits divided by ``temperature``; ``(B, T)``
            0/1 mask; per-token cap, a clipped token gives no gradient).
        chunk_size / vocab_chunk_size: tokens / vocabulary entries per tile (None: a tile of
            about 1M logits on the CPU, 2M on a GPU); memory and speed only, not values.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"liger"`` (module docstring).

    Returns:
        ``(loss, metrics)`` with ``generalized_jsd``'s metrics: ``jsd/loss``, ``jsd/tokens``,
        ``jsd/clip_frac``, ``jsd/empty_mask``. The loss is float32 for low-precision inputs.
    """
    if teacher_weight is None:
        teacher_weight = weight
        if teacher_bias is None:
            teacher_bias = bias
    _check_inputs(student_hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias)
    beta = check_scalar("beta", beta, low=0.0, high=1.0)
    temperature = check_scalar("temperature", temperature, low=0.0, low_open=True)
    if token_clip is not None:
        token_clip = check_scalar("token_clip", token_clip, low=0.0, low_open=True)
    _check_chunk("chunk_size", chunk_size)
    _check_chunk("vocab_chunk_size", vocab_chunk_size)
    if backend not in FUSED_JSD_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(FUSED_JSD_BACKENDS)}, got {backend!r}")
    m = as_bool_mask("mask", mask, student_hidden.shape[:2], student_hidden.device)
    stats: dict[str, float] = {}
    settings = (beta, temperature, token_clip, chunk_size, vocab_chunk_size, backend)
    loss: Tensor = _FusedLinearJSD.apply(  # type: ignore[no-untyped-call]
        student_hidden,
        weight,
        bias,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        m,
        settings,
        stats,
        torch.is_grad_enabled(),
    )
    metrics = {
        "jsd/loss": float(loss.detach()),
        "jsd/tokens": stats["tokens"],
        "jsd/clip_frac": stats["clip_frac"],
        "jsd/empty_mask": 1.0 if stats["tokens"] == 0 else 0.0,
    }
    return loss, metrics


# ------------------------------------------------------------------- channel 3: token log-probs
_LOGPS_CREATE_GRAPH = (
    "create_graph=True is not supported through fused_linear_logps: its backward recomputes the "
    "logits' gradient in closed form without a graph. Take this loss's gradient in a backward "
    "without create_graph."
)


class _LogpsCtx(Protocol):
    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[Tensor, ...]
    has_bias: bool
    settings: tuple[float, int | None, int | None]

    def save_for_backward(self, *tensors: Tensor) -> None: ...


def _logps_problem(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    index: Tensor,
    settings: tuple[float, int | None, int | None],
) -> LogpsProblem:
    temperature, token_chunk, vocab_chunk = settings
    return LogpsProblem(
        hs=_rows(hidden, index),
        weight=weight.detach(),
        bias=None if bias is None else bias.detach(),
        ids=ids.reshape(-1).index_select(0, index),
        temperature=temperature,
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
    )


class _FusedLinearLogps(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _LogpsCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        mask: Tensor,
        settings: tuple[float, int | None, int | None],
    ) -> Tensor:
        B, T, _ = hidden.shape
        index = mask.reshape(-1).nonzero().squeeze(-1)
        problem = _logps_problem(hidden, weight, bias, ids, index, settings)
        _check_finite("hidden", problem.hs)
        dtype = problem.compute_dtype
        out = torch.zeros(B * T, dtype=dtype, device=hidden.device)
        lse = torch.zeros(0, dtype=dtype, device=hidden.device)
        if index.numel():
            logps, lse = linear_logps(problem)
            out.index_copy_(0, index, logps)
        tensors = [hidden.detach(), weight.detach(), ids, index, lse]
        if bias is not None:
            tensors.append(bias.detach())
        ctx.save_for_backward(*tensors)
        ctx.has_bias = bias is not None
        ctx.settings = settings
        return out.view(B, T)

    @staticmethod
    def backward(ctx: _LogpsCtx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward runs with grad mode on only for create_graph=True
            raise RuntimeError(_LOGPS_CREATE_GRAPH)
        hidden, weight, ids, index, lse, *rest = ctx.saved_tensors
        bias = rest[0] if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = bool(need_b) and bias is not None
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = grad_b = None
        if index.numel() and (need_h or need_w or need_b):
            problem = _logps_problem(hidden, weight, bias, ids, index, ctx.settings)
            grad = grad_output.reshape(-1).index_select(0, index)
            rows, grad_w, grad_b = linear_logps_backward(
                problem,
                lse,
                grad,
                need_hidden=bool(need_h),
                need_weight=bool(need_w),
                need_bias=need_b,
            )
            if grad_h is not None and rows is not None:
                grad_h.view(-1, hidden.shape[-1]).index_copy_(0, index, rows.to(hidden.dtype))
        if need_w and grad_w is None:
            grad_w = torch.zeros_like(weight)
        if need_b and grad_b is None and bias is not None:
            grad_b = torch.zeros_like(bias)
        return grad_h, grad_w, grad_b, None, None, None


def fused_linear_logps(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> Tensor:
    """Log-probs ``(B, T)`` of the tokens ``ids`` under ``softmax((hidden @ weight.T + bias) /
    temperature)``: ``selective_log_softmax`` on those logits, without building them.

    Args:
        hidden: ``(B, T, H)`` last hidden states (the output layer's input for each position
            that scores a token), differentiable.
        weight / bias: ``(V, H)`` / ``(V,)`` or None, the output layer (``lm_head``; tied or
            not), differentiable.
        ids: ``(B, T)`` the tokens scored.
        mask: ``(B, T)`` 0/1; positions outside it are not computed, hold 0 and get no gradient
            (default: all).
        temperature: the logits are divided by it (channel 3 scores at 1).
        chunk_size / vocab_chunk_size: token rows / vocabulary columns per tile (None: about 1M
            logits on the CPU, 2M on a GPU); memory and speed only, not values.

    Returns:
        ``(B, T)`` log-probs, float32 for low-precision inputs (else the inputs' dtype).
    """
    check_tensor("hidden", hidden, ndim=3)
    check_tensor("weight", weight, ndim=2)
    check_tensor("ids", ids, ndim=2)
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}"
        )
    if ids.shape != hidden.shape[:2]:
        raise ValueError(
            f"ids has shape {tuple(ids.shape)} but hidden has {tuple(hidden.shape)}; they must "
            "share (B, T)"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight is (V, H) = {tuple(weight.shape)} but hidden has H = {hidden.shape[-1]}; "
            "pass the output layer's weight (lm_head.weight)"
        )
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],)):
        shape = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"bias must be None or a (V,) = ({weight.shape[0]},) tensor, got {shape}")
    if hidden.device != weight.device:
        raise ValueError(
            f"hidden and weight must be on one device, got {hidden.device} and {weight.device}"
        )
    temperature = check_scalar("temperature", temperature, low=0.0, low_open=True)
    _check_chunk("chunk_size", chunk_size)
    _check_chunk("vocab_chunk_size", vocab_chunk_size)
    m = as_bool_mask("mask", mask, hidden.shape[:2], hidden.device)
    token_ids = ids.to(device=hidden.device, dtype=torch.long)
    if m.any():
        selected = token_ids[m]
        if int(selected.min()) < 0 or int(selected.max()) >= weight.shape[0]:
            raise ValueError(f"ids must lie in [0, V={weight.shape[0]}) at unmasked positions")
    settings = (temperature, chunk_size, vocab_chunk_size)
    result: Tensor = _FusedLinearLogps.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, token_ids, m, settings
    )
    return result
