"""What only a CUDA device shows (every test is marked ``gpu``: skipped with the reason elsewhere,
run by ``pytest -m gpu`` and scripts/gpu-check.sh on a GPU machine).

* ComposerConfig resolves TRL's GPU defaults there (bf16 autocast, gradient checkpointing), and a
  run config asks for bf16 autocast only with bf16 weights;
* under bf16 autocast, channels off is still GRPOTrainer bit for bit (deterministic kernels:
  tests/conftest.py), and the logits-capturing head agrees with TRL's to bf16 precision;
* the chunked distillation backward peaks at one gradient buffer (CUDA's allocator statistics,
  exact where the CPU test has to read the process's resident memory);
* a tiny run trains on the GPU with its defaults and reports cuda and bfloat16.

The bounds here are derived (each comment says how) and were not measured when written: the
device machine prints the measured values (scripts/gpu-check.sh, COMPOSER_DIFF_LOG).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _trainer_helpers import (
    config,
    generation_batch,
    loss_and_grads,
    make_trainer,
    oracle_store,
    plain_reward,
)
from tolerances import UBF16
from trl import GRPOTrainer

pytestmark = pytest.mark.gpu


def _log(what: str, **values: float) -> None:
    """Measured figures for scripts/gpu-check.sh (COMPOSER_DIFF_LOG), as tolerances.py logs."""
    path = os.environ.get("COMPOSER_DIFF_LOG")
    if path:
        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "what": what}
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({**record, **values}) + "\n")


def test_cuda_defaults_are_bf16_autocast_and_gradient_checkpointing(tmp_path):
    from composer_replication.assembly.build import trainer_args
    from composer_replication.config import load_config
    from composer_replication.trainer import ComposerConfig

    args = ComposerConfig(output_dir=str(tmp_path))
    assert args.bf16 is True and args.gradient_checkpointing is True  # TRL's GPU settings
    # A run autocasts to bf16 only when its weights are bf16 (model.dtype), never silently.
    bf16 = trainer_args(load_config(overrides=["model.dtype=bfloat16"]), str(tmp_path), 1, 0)
    fp32 = trainer_args(load_config(), str(tmp_path), 1, 0)
    assert bf16.bf16 is True and fp32.bf16 is False and not fp32.use_cpu


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].float().reshape(-1) for name in sorted(grads)])


def test_bf16_channels_off_is_grpo_trainer_and_the_capture_head_agrees(tmp_path):
    args = dict(loss_type="dapo", beta=0.0, bf16=True)  # bf16 autocast, as training runs it
    composer = make_trainer(
        tmp_path,
        reward=plain_reward,
        args=config(tmp_path, **args),
        alpha_sdpo=0.0,
        beta_replay=0.0,
    )
    plain = make_trainer(
        tmp_path,
        reward=plain_reward,
        args=config(tmp_path, **args),
        cls=GRPOTrainer,
        save_to=tmp_path / "ref",
    )
    assert composer.model.device.type == "cuda"
    inputs = generation_batch(composer)
    assert inputs["advantages"].abs().sum() > 0
    with composer.accelerator.autocast():
        loss_c, grads_c = loss_and_grads(composer, inputs)
    with plain.accelerator.autocast():
        loss_p, grads_p = loss_and_grads(plain, inputs)
    # The same code path with deterministic kernels: bit for bit, in bf16 as in fp32.
    assert torch.equal(loss_c, loss_p)
    for name in grads_c:
        assert torch.equal(grads_c[name], grads_p[name]), name

    capturing = make_trainer(
        tmp_path, reward=plain_reward, args=config(tmp_path, **args), alpha_sdpo=0.1
    )
    capturing.model.zero_grad(set_to_none=True)
    capturing._capture_logits = True
    with capturing.accelerator.autocast():
        loss_k = GRPOTrainer._compute_loss(capturing, capturing.model, inputs)
    loss_k.backward()
    # beta = 0 and the first iteration: each token's ratio is exp(logp - logp.detach()) = exp(0),
    # exactly 1 whatever logp's rounding, so both losses are -sum(advantage) / tokens: equal.
    assert torch.equal(loss_k.detach(), loss_p)
    # The gradients: both heads read the same bf16 logits. Each side's gradient is at most one
    # bf16 rounding (u = 2**-8) per layer output, at the logits and at the log-softmax's input
    # gradient away from exact, relative to its norm: (L + 2) u each, 2 (L + 2) u between them.
    layers = capturing.model.config.num_hidden_layers
    bound = 2 * (layers + 2) * UBF16
    got = _flat({n: p.grad for n, p in capturing.model.named_parameters()})
    ref = _flat(grads_p)
    rel = float((got - ref).norm() / ref.norm())
    _log(
        "bf16 capture head vs TRL: relative gradient norm",
        measured=rel,
        bound=bound,
        ratio=rel / bound,
    )
    assert rel <= bound, f"relative gradient difference {rel:.3g} > {bound:.3g}"


def test_chunked_jsd_backward_peaks_at_one_gradient_buffer_on_cuda():
    """CUDA's allocator counts every tensor byte: the backward's extra memory is the gradient
    buffer itself plus one chunk's temporaries (loss/_chunked.py), while a retained graph keeps
    the buffer and hands .grad a copy (two buffers)."""
    from composer_replication.loss import generalized_jsd

    device = torch.device("cuda")
    B, T, V, chunk = 1, 1024, 32768, 4
    gen = torch.Generator(device=device).manual_seed(0)
    s = torch.randn(B, T, V, device=device, generator=gen)
    t = torch.randn(B, T, V, device=device, generator=gen)
    mask = torch.ones(B, T, device=device)
    grad_bytes = s.numel() * s.element_size()  # one fp32 (B, T, V) buffer: 128 MiB

    def extra_peak(retain: bool) -> int:
        x = s.clone().requires_grad_(True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss, _ = generalized_jsd(x, t, beta=0.5, mask=mask, chunk_size=chunk)
        loss.backward(retain_graph=retain)
        torch.cuda.synchronize(device)
        assert x.grad is not None and x.grad.shape == x.shape
        return torch.cuda.max_memory_allocated(device) - base

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one chunk in flight (loss/_parallel.py runs one per CPU thread)
    try:
        ours = extra_peak(False)
        retained = extra_peak(True)
    finally:
        torch.set_num_threads(threads)
    # One chunk holds ~20 (chunk, V) fp32 temporaries (loss/_parallel.py); 32 bounds them.
    bound = grad_bytes + 32 * chunk * V * 4
    _log(
        "chunked JSD backward peak / one gradient buffer",
        measured=ours / grad_bytes,
        bound=bound / grad_bytes,
        retained=retained / grad_bytes,
    )
    assert ours <= bound, f"peak {ours / grad_bytes:.3f}x one gradient buffer"
    assert retained >= 2 * grad_bytes - 32 * chunk * V * 4, f"{retained / grad_bytes:.3f}x"


def test_a_tiny_run_trains_on_the_gpu_with_its_defaults(tmp_path):
    """ComposerConfig's CUDA defaults (bf16 autocast over fp32 weights, gradient checkpointing)
    through TRL's training loop with all three channels; the replica reports what it used."""
    from composer_replication.run.replica import device_record

    args = config(tmp_path, beta=0.0, bf16=None, gradient_checkpointing=None, max_steps=2)
    trainer = make_trainer(
        tmp_path,
        store=oracle_store(),
        args=args,
        alpha_sdpo=0.5,
        beta_replay=0.5,
        dpo_variant="simpo",
    )
    assert trainer.args.bf16 is True and trainer.args.gradient_checkpointing is True
    trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(x)) for x in losses)
    steps = [h for h in history if "time/step_s" in h]
    assert steps and all(h["time/loss_backward_s"] >= 0 and h["time/teacher_s"] > 0 for h in steps)
    assert any(h.get("sdpo/active") for h in history) and any(
        h.get("replay/active") for h in history
    )
    record = device_record(trainer, "generate")
    assert record["device"].startswith("cuda") and record["device_name"]
    assert record["param_dtype"] == "float32" and record["autocast"] == "bfloat16"
    assert record["gradient_checkpointing"] is True
