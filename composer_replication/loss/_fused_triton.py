# mypy: disable-error-code="no-untyped-def,untyped-decorator"

"""Triton kernels for the element-wise passes of the fused generalized JSD (``_fused_math``).

The matmuls that produce each ``(n, vc)`` logits tile and consume the gradient tile are cuBLAS's
(``run_tiled``); what the kernels fuse is everything in between, so a tile is read once per pass
and no ``(n, vc)`` temporary is allocated: adding the bias, dividing by the temperature, the
online log-sum-exp (pass A), the per-token loss and row constant (pass B) and the gradient tile
(pass C). One program per token row loops over the tile's columns in blocks of ``BLOCK``; rows
are independent, so there are no atomics and the result is deterministic.

The formulas are `TorchTileOps`' (module docstring of ``_fused_math``), in float32. The only
difference in the arithmetic is ``logaddexp(a, b) = max + log(exp(a - max) + exp(b - max))``
(PyTorch writes ``max + log1p(exp(-|a - b|))``): at most one float32 rounding of ``log m``.

Tested on the CPU with ``TRITON_INTERPRET=1`` (tests/loss/test_loss_fused_jsd.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from composer_replication.loss._fused_math import beta_mode

MAX_BLOCK = 1024  # columns per loop step of a row program (4 KB of float32 per operand)


@triton.jit
def _logits(ptr, bias_ptr, cols, valid, temperature, HAS_BIAS: tl.constexpr):
    x = tl.load(ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    return x / temperature


@triton.jit
def _logaddexp(a, b):
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _lse_kernel(
    s_ptr,
    t_ptr,
    bs_ptr,
    bt_ptr,
    max_s_ptr,
    sum_s_ptr,
    max_t_ptr,
    sum_t_ptr,
    n_cols,
    stride_s,
    stride_t,
    temperature,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    m_s = tl.load(max_s_ptr + row)
    l_s = tl.load(sum_s_ptr + row)
    m_t = tl.load(max_t_ptr + row)
    l_t = tl.load(sum_t_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        s = tl.where(valid, _logits(s_row, bs_ptr, cols, valid, temperature, HAS_BS), -float("inf"))
        t = tl.where(valid, _logits(t_row, bt_ptr, cols, valid, temperature, HAS_BT), -float("inf"))
        new_s = tl.maximum(m_s, tl.max(s, axis=0))
        l_s = l_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(s - new_s), axis=0)
        m_s = new_s
        new_t = tl.maximum(m_t, tl.max(t, axis=0))
        l_t = l_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(t - new_t), axis=0)
        m_t = new_t
    tl.store(max_s_ptr + row, m_s)
    tl.store(sum_s_ptr + row, l_s)
    tl.store(max_t_ptr + row, m_t)
    tl.store(sum_t_ptr + row, l_t)


@triton.jit
def _loss_kernel(
    s_ptr,
    t_ptr,
    bs_ptr,
    bt_ptr,
    lse_s_ptr,
    lse_t_ptr,
    loss_ptr,
    const_ptr,
    n_cols,
    stride_s,
    stride_t,
    temperature,
    beta,
    log_1m_beta,
    log_beta,
    MODE: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    acc_loss = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_const = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        log_q = _logits(s_row, bs_ptr, cols, valid, temperature, HAS_BS) - lse_s
        log_p = _logits(t_row, bt_ptr, cols, valid, temperature, HAS_BT) - lse_t
        if MODE == 0:
            term = tl.exp(log_p) * (log_p - log_q)
            acc_loss += tl.where(valid, term, 0.0)
        elif MODE == 1:
            term = tl.exp(log_q) * (log_q - log_p)
            acc_loss += tl.where(valid, term, 0.0)
            acc_const += tl.where(valid, term, 0.0)
        else:
            log_m = _logaddexp(log_q + log_1m_beta, log_p + log_beta)
            kl_p = tl.exp(log_p) * (log_p - log_m)
            kl_q = tl.exp(log_q) * (log_q - log_m)
            acc_loss += tl.where(valid, beta * kl_p + (1.0 - beta) * kl_q, 0.0)
            acc_const += tl.where(valid, kl_q, 0.0)
    tl.store(loss_ptr + row, tl.load(loss_ptr + row) + tl.sum(acc_loss, axis=0))
    if MODE != 0:
        tl.store(const_ptr + row, tl.load(const_ptr + row) + tl.sum(acc_const, axis=0))


@triton.jit
def _grad_kernel(
    s_ptr,
    t_ptr,
    bs_ptr,
    bt_ptr,
    lse_s_ptr,
    lse_t_ptr,
    const_ptr,
    coef_ptr,
    g_ptr,
    n_cols,
    stride_s,
    stride_t,
    stride_g,
    temperature,
    log_1m_beta,
    log_beta,
    MODE: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    g_row = g_ptr + row * stride_g
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    const = tl.load(const_ptr + row)
    coef = tl.load(coef_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        log_q = _logits(s_row, bs_ptr, cols, valid, temperature, HAS_BS) - lse_s
        log_p = _logits(t_row, bt_ptr, cols, valid, temperature, HAS_BT) - lse_t
        q = tl.exp(log_q)
        if MODE == 0:
            g = q - tl.exp(log_p)
        elif MODE == 1:
            g = q * (log_q - log_p - const)
        else:
            g = q * (log_q - _logaddexp(log_q + log_1m_beta, log_p + log_beta) - const)
        tl.store(g_row + cols, (g * coef).to(g_ptr.dtype.element_ty), mask=valid)


class TritonTileOps:
    """`_fused_math.TileOps` as Triton kernels (float32 tiles and row vectors)."""

    def __init__(self, beta: float, temperature: float) -> None:
        self.mode = beta_mode(beta)
        self.beta = float(beta)
        self.temperature = float(temperature)
        # log(1 - beta), log(beta): only the mixture reads them (finite placeholders otherwise)
        self.log_1m_beta = math.log1p(-beta) if self.mode == 2 else 0.0
        self.log_beta = math.log(beta) if self.mode == 2 else 0.0

    @staticmethod
    def _launch(s: Tensor) -> tuple[tuple[int], int]:
        if s.dtype != torch.float32 or s.stride(-1) != 1:
            raise ValueError("the Triton tile kernels take row-major float32 logits tiles")
        return (s.shape[0],), min(MAX_BLOCK, triton.next_power_of_2(max(s.shape[1], 1)))

    def lse_update(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        max_s: Tensor,
        sum_s: Tensor,
        max_t: Tensor,
        sum_t: Tensor,
    ) -> None:
        grid, block = self._launch(s)
        _lse_kernel[grid](
            s,
            t,
            s if bs is None else bs,
            t if bt is None else bt,
            max_s,
            sum_s,
            max_t,
            sum_t,
            s.shape[1],
            s.stride(0),
            t.stride(0),
            self.temperature,
            HAS_BS=bs is not None,
            HAS_BT=bt is not None,
            BLOCK=block,
        )

    def loss_update(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
        loss: Tensor,
        const: Tensor,
    ) -> None:
        grid, block = self._launch(s)
        _loss_kernel[grid](
            s,
            t,
            s if bs is None else bs,
            t if bt is None else bt,
            lse_s,
            lse_t,
            loss,
            const,
            s.shape[1],
            s.stride(0),
            t.stride(0),
            self.temperature,
            self.beta,
            self.log_1m_beta,
            self.log_beta,
            MODE=self.mode,
            HAS_BS=bs is not None,
            HAS_BT=bt is not None,
            BLOCK=block,
        )

    def grad_tile(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
        const: Tensor,
        coef: Tensor,
        out: Tensor,
    ) -> None:
        grid, block = self._launch(s)
        _grad_kernel[grid](
            s,
            t,
            s if bs is None else bs,
            t if bt is None else bt,
            lse_s,
            lse_t,
            const,
            coef,
            out,
            s.shape[1],
            s.stride(0),
            t.stride(0),
            out.stride(0),
            self.temperature,
            self.log_1m_beta,
            self.log_beta,
            MODE=self.mode,
            HAS_BS=bs is not None,
            HAS_BT=bt is not None,
            BLOCK=block,
        )
