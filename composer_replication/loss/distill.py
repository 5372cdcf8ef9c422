"""Channel 2: distillation divergences between student and teacher logits.

Shapes: logits ``(B, T, V)``, mask ``(B, T)`` (0/1; None = all tokens). Every loss is a token-mean
over the mask, computed in chunks of ``chunk_size`` tokens (see ``_chunked``) so memory stays at
one ``B*T*V`` gradient buffer (scaled in place by a backward that does not retain the graph; a
retained graph costs one more) instead of a dozen. The teacher side never gets a gradient.
Gradients are first order only: a backward with ``create_graph=True`` raises. An all-false mask
gives loss 0, zero gradient and ``<name>/empty_mask = 1.0``.

Conventions (easy to flip; see reference/loss.md). ``q`` = student, ``p`` = teacher:

- ``generalized_jsd``: beta=0 is forward KL(p || q) (mode covering), beta=1 is reverse
  KL(q || p) (mode seeking); otherwise, as TRL's ``GKDTrainer.generalized_jsd_loss`` and SDPO,
  ``m = (1-beta) q + beta p`` and ``JSD = beta KL(p || m) + (1-beta) KL(q || m)``.
- ``taid_loss``: cross-entropy to the interpolated target ``softmax((1-t) sg(z_q) + t z_p)``
  (SakanaAI TAID). At t=1 it is forward KL plus the teacher entropy (a constant).
- ``entropy_opd_loss``: per-token teacher-entropy gate between forward and reverse KL.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from composer_replication.loss._checks import (
    as_bool_mask,
    check_choice,
    check_scalar,
    check_tensor,
)
from composer_replication.loss._chunked import PerTokenFn, autograd_kernel, chunked_token_mean
from composer_replication.loss._kernels import entropy_opd_kernel, jsd_kernel, taid_kernel

DEFAULT_ENTROPY_OPD_H_MAX = 0.8  # nats; the Entropy-aware OPD paper's tau
TAID_T_START, TAID_T_END = 0.4, 1.0  # TAID's t schedule: start and end (the TAID paper's code)
TAID_ALPHA, TAID_BETA = 5e-4, 0.99  # TAID's adaptive step size and loss-change momentum (same)


def _check_logits(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None, chunk_size: int | None
) -> Tensor:
    check_tensor("student_logits", student_logits, ndim=3)
    check_tensor("teacher_logits", teacher_logits, ndim=3)
    if teacher_logits.shape[-1] != student_logits.shape[-1]:
        raise ValueError(
            f"vocab mismatch: student_logits has V={student_logits.shape[-1]} but teacher_logits has "
            f"V={teacher_logits.shape[-1]}; student and teacher must share one tokenizer/vocabulary"
        )
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits has shape {tuple(teacher_logits.shape)} but student_logits has shape "
            f"{tuple(student_logits.shape)}; they must match"
        )
    if not student_logits.is_floating_point() or not teacher_logits.is_floating_point():
        raise ValueError("student_logits and teacher_logits must be floating point")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None (auto), got {chunk_size!r}")
    return as_bool_mask("mask", mask, student_logits.shape[:2], student_logits.device)


def divergence(log_q: Tensor, log_p: Tensor, beta: float) -> Tensor:
    """Per-row generalized JSD between log-prob rows ``log_q`` (student), ``log_p`` (teacher).

    ``(n, K), (n, K) -> (n,)``; beta as in ``generalized_jsd``. Differentiable in both.
    """
    if beta == 0.0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if beta == 1.0:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_q + math.log1p(-beta), log_p + math.log(beta))
    kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_p + (1 - beta) * kl_q


def _tail_bucket(log_probs: Tensor) -> Tensor:
    # Append log(1 - sum p) so the top-k support plus one "everything else" category sums to 1.
    # expm1 keeps precision when the top-k mass is close to 1; the clamp avoids log(0).
    log_mass = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_mass))], dim=-1)


def _topk_jsd_fn(beta: float, temperature: float, top_k: int, add_tail: bool) -> PerTokenFn:
    def fn(s: Tensor, t: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        s = s / temperature
        t = t / temperature
        # Support = the student's top-k tokens (selection is not differentiated), as SDPO.
        idx = torch.topk(s.detach(), k=top_k, dim=-1).indices
        log_q = s.gather(-1, idx) - torch.logsumexp(s, -1, keepdim=True)
        log_p = t.gather(-1, idx) - torch.logsumexp(t, -1, keepdim=True)
        if add_tail:
            log_q, log_p = _tail_bucket(log_q), _tail_bucket(log_p)
        else:  # divergence of the top-k conditionals
            log_q = log_q - torch.logsumexp(log_q, -1, keepdim=True)
            log_p = log_p - torch.logsumexp(log_p, -1, keepdim=True)
        return divergence(log_q, log_p, beta), {}

    return fn


def _empty_metric(name: str, stats: dict[str, float]) -> dict[str, float]:
    return {f"{name}/empty_mask": 1.0 if stats.get("tokens", 0.0) == 0 else 0.0}


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    token_clip: float | None = None,
    top_k: int | None = None,
    add_tail: bool = True,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Generalized Jensen-Shannon divergence, token-mean over ``mask``.

    Args:
        student_logits: ``(B, T, V)``, differentiable.
        teacher_logits: ``(B, T, V)``, never differentiated.
        beta: in ``[0, 1]``; 0 = forward KL(teacher || student), 1 = reverse KL(student ||
            teacher), otherwise the TRL/SDPO mixture form (see module docstring).
        temperature: > 0; both logits are divided by it (no T^2 factor, as TRL).
        mask: ``(B, T)`` 0/1 token mask.
        token_clip: optional > 0 cap on each token's divergence (clipped tokens give no gradient).
        top_k: if set, the divergence is taken on the student's top-k tokens (SDPO style), with
            one tail bucket holding the remaining mass (``add_tail=True``) or renormalised.
        chunk_size: tokens per chunk (None = about 1M logits per chunk); only affects
            memory and speed, not values.

    Returns:
        ``(loss, metrics)``: ``jsd/loss``, ``jsd/tokens``, ``jsd/clip_frac``, ``jsd/empty_mask``.
    """
    m = _check_logits(student_logits, teacher_logits, mask, chunk_size)
    beta = check_scalar("beta", beta, low=0.0, high=1.0)
    temperature = check_scalar("temperature", temperature, low=0.0, low_open=True)
    if token_clip is not None:
        token_clip = check_scalar("token_clip", token_clip, low=0.0, low_open=True)
    if top_k is not None:
        if (
            isinstance(top_k, bool)
            or not isinstance(top_k, int)
            or not 1 <= top_k <= student_logits.shape[-1]
        ):
            raise ValueError(
                f"top_k must be an int in [1, V={student_logits.shape[-1]}], got {top_k!r}"
            )
    if top_k is None:
        kernel = jsd_kernel(beta, temperature)
    else:  # small (n, k) support: per-chunk autograd is cheap and keeps the code obvious
        kernel = autograd_kernel(_topk_jsd_fn(beta, temperature, top_k, add_tail))
    loss, stats = chunked_token_mean(
        student_logits, teacher_logits, m, kernel, token_clip=token_clip, chunk_size=chunk_size
    )
    metrics = {
        "jsd/loss": float(loss.detach()),
        "jsd/tokens": stats["tokens"],
        "jsd/clip_frac": stats["clip_frac"],
        **_empty_metric("jsd", stats),
    }
    return loss, metrics


def taid_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    t: float,
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """TAID: cross-entropy from the time-interpolated target to the student, token-mean.

    ``p_t = softmax((1 - t) * sg(z_student) + t * z_teacher)``; ``loss = -sum_v p_t log q``.
    Interpolation is in logit space with the student side detached, as SakanaAI's TAID code
    (which has no temperature; ``temperature`` here divides both logits first, 1.0 = TAID).
    At t=0 the target is the student itself, so the gradient is exactly zero; at t=1 the gradient
    equals forward KL(teacher || student)'s (the values differ by the teacher entropy).

    Args:
        t: interpolation coefficient in ``[0, 1]`` (drive it with ``TAIDScheduler``).
    Returns:
        ``(loss, metrics)``: ``taid/loss``, ``taid/t``, ``taid/tokens``, ``taid/empty_mask``.
    """
    m = _check_logits(student_logits, teacher_logits, mask, chunk_size)
    t = check_scalar("t", t, low=0.0, high=1.0)
    temperature = check_scalar("temperature", temperature, low=0.0, low_open=True)

    loss, stats = chunked_token_mean(
        student_logits,
        teacher_logits,
        m,
        taid_kernel(t, temperature),
        token_clip=None,
        chunk_size=chunk_size,
    )
    metrics = {
        "taid/loss": float(loss.detach()),
        "taid/t": t,
        "taid/tokens": stats["tokens"],
        **_empty_metric("taid", stats),
    }
    return loss, metrics


def entropy_opd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    h_max: float = DEFAULT_ENTROPY_OPD_H_MAX,
    mask: Tensor | None = None,
    mode: str = "switch",
    fkl_coef: float = 1.0,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Entropy-gated on-policy distillation, token-mean over ``mask``.

    Per token, ``H = -sum p log p`` is the teacher entropy (nats, after ``temperature``).

    - ``mode="switch"`` (default): ``loss_t = KL(p || q)`` if ``H > h_max`` else ``KL(q || p)``.
      Where the teacher is unsure (flat), mode-seeking reverse KL would collapse the student
      onto one of several acceptable tokens, so the mode-covering forward KL is used instead;
      where the teacher is confident, reverse KL.
    - ``mode="add"``: ``loss_t = KL(q || p) + fkl_coef * 1[H > h_max] * KL(p || q)``. This is the
      shape of Entropy-aware OPD (Jin et al., arXiv 2603.07079): reverse-KL OPD everywhere plus
      a gated forward-KL term (paper: tau = 0.8, lambda = 1). The paper optimises the reverse KL
      as a clipped policy gradient on sampled tokens and a top-16 forward KL; here both are exact
      full-vocabulary divergences on the given logits.

    Both are exactly 0 (with zero gradient) when student == teacher.

    Returns:
        ``(loss, metrics)``: ``eopd/loss``, ``eopd/gate_frac`` (fraction of tokens using forward
        KL), ``eopd/teacher_entropy``, ``eopd/tokens``, ``eopd/empty_mask``.
    """
    m = _check_logits(student_logits, teacher_logits, mask, chunk_size)
    h_max = check_scalar("h_max", h_max, low=0.0)
    check_choice("mode", mode, ("switch", "add"))
    fkl_coef = check_scalar("fkl_coef", fkl_coef, low=0.0)
    temperature = check_scalar("temperature", temperature, low=0.0, low_open=True)

    kernel = entropy_opd_kernel(h_max, mode, fkl_coef, temperature)
    loss, stats = chunked_token_mean(
        student_logits, teacher_logits, m, kernel, token_clip=None, chunk_size=chunk_size
    )
    metrics = {
        "eopd/loss": float(loss.detach()),
        "eopd/gate_frac": stats.get("gate_frac", 0.0),
        "eopd/teacher_entropy": stats.get("teacher_entropy", 0.0),
        "eopd/tokens": stats["tokens"],
        **_empty_metric("eopd", stats),
    }
    return loss, metrics


class TAIDScheduler:
    """Adaptive schedule for TAID's t (SakanaAI TAID ``update_t``), host-side python floats.

    Call ``step(loss, global_step, total_steps)`` once per optimisation step with the TAID loss of
    that step; ``t`` is the value to use for the *next* loss. Rule (defaults as the paper's code):

    - first call: remember the loss, t unchanged (no previous loss to compare);
    - then ``rel = (prev - loss) / (prev + 1e-15)``; ``m = beta * m + (1 - beta) * rel``;
      ``dt = alpha * sigmoid(m) * (1 - t)``; ``t_lin = t_start + (t_end - t_start) * step/total``;
      ``t = min(t_end, max(t_lin, t + dt))`` (linear floor, momentum-driven faster increase).

    ``adaptive=False`` gives the plain linear schedule ``t = t_lin``.
    """

    def __init__(
        self,
        t_start: float = TAID_T_START,
        t_end: float = TAID_T_END,
        alpha: float = TAID_ALPHA,
        beta: float = TAID_BETA,
        *,
        adaptive: bool = True,
    ) -> None:
        self.t_start = check_scalar("t_start", t_start, low=0.0, high=1.0, high_open=True)
        self.t_end = check_scalar("t_end", t_end, low=0.0, high=1.0, low_open=True)
        if self.t_end < self.t_start:
            raise ValueError(f"t_end ({t_end}) must be >= t_start ({t_start})")
        self.alpha = check_scalar("alpha", alpha, low=0.0, high=1.0)
        self.beta = check_scalar("beta", beta, low=0.0, high=1.0)
        self.adaptive = adaptive
        self.t = self.t_start
        self.momentum = 0.0
        self.prev_loss: float | None = None

    def step(self, loss: float | Tensor, global_step: int, total_steps: int) -> float:
        """Update and return t from this step's loss (a float or 0-dim tensor)."""
        value = float(loss.detach()) if isinstance(loss, Tensor) else float(loss)
        if not math.isfinite(value):
            raise ValueError(f"loss must be finite, got {value}")
        if total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {total_steps}")
        if global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {global_step}")
        if self.prev_loss is None:
            self.prev_loss = value
            return self.t
        rel = (self.prev_loss - value) / (self.prev_loss + 1e-15)
        self.momentum = self.beta * self.momentum + (1 - self.beta) * rel
        t_lin = self.t_start + (self.t_end - self.t_start) * global_step / total_steps
        if self.adaptive:
            dt = self.alpha * (1.0 / (1.0 + math.exp(-self.momentum))) * (1 - self.t)
            self.t = min(self.t_end, max(t_lin, self.t + dt))
        else:
            self.t = t_lin
        self.prev_loss = value
        return self.t

    def state_dict(self) -> dict[str, float | None]:
        """Checkpointable state (t, momentum, previous loss)."""
        return {"t": self.t, "momentum": self.momentum, "prev_loss": self.prev_loss}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        """Restore the state written by ``state_dict``."""
        t, momentum = state["t"], state["momentum"]
        if t is None or momentum is None:
            raise ValueError("state must hold numeric 't' and 'momentum'")
        self.t, self.momentum, self.prev_loss = float(t), float(momentum), state["prev_loss"]
