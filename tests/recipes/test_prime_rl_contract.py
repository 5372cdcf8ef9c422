"""The PRIME-RL contract: the mirrored dataclasses, the TOML example, PRIME-RL's calling convention.

prime-rl 0.8 needs Python 3.12 and vLLM, so the comparison with the real classes runs only where
it is importable; elsewhere it is skipped, saying so. The pinned field lists below are those of
prime-rl 0.8.0 @559b447 (src/prime_rl/trainer/rl/loss.py, packages/prime-rl-configs/.../trainer.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import tomllib
from pathlib import Path

import pytest
import torch

from composer_replication.recipes.prime_rl import (
    CustomLossConfig,
    LossInputs,
    LossOutputs,
    PrimeRLLossConfig,
    loss_fn,
)
from composer_replication.recipes.prime_rl.contract import PRIME_RL_DEFAULT_LOSS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "prime_rl" / "composer_rl.toml"

PINNED = {
    LossInputs: [
        ("trainer_logprobs", dataclasses.MISSING),
        ("inference_logprobs", dataclasses.MISSING),
        ("ref_logprobs", dataclasses.MISSING),
        ("advantages", dataclasses.MISSING),
        ("loss_mask", dataclasses.MISSING),
        ("loss_weights", None),
    ],
    LossOutputs: [("loss", dataclasses.MISSING), ("metrics", dataclasses.MISSING)],
}


def fields(cls):
    return [(f.name, f.default) for f in dataclasses.fields(cls)]


def test_mirror_has_prime_rl_08_fields():
    for cls, expected in PINNED.items():
        assert fields(cls) == expected, cls.__name__
    cfg = CustomLossConfig(import_path="a.b")
    assert (cfg.type, cfg.import_path, cfg.kwargs) == ("custom", "a.b", {})
    assert [f.name for f in dataclasses.fields(CustomLossConfig)] == [
        "type",
        "import_path",
        "kwargs",
    ]


def _prime_rl():
    try:
        loss = importlib.import_module("prime_rl.trainer.rl.loss")
        configs = importlib.import_module("prime_rl.configs.trainer")
    except Exception as exc:  # ImportError, or a partial install failing at import time
        pytest.skip(
            "prime-rl is not importable here (it needs Python 3.12 and vLLM; "
            f"{type(exc).__name__}: {exc}); the mirror is checked against the pinned field lists"
        )
    return loss, configs


def test_mirror_matches_real_prime_rl():
    loss, configs = _prime_rl()
    assert fields(LossInputs) == fields(loss.LossInputs)
    assert fields(LossOutputs) == fields(loss.LossOutputs)
    real = configs.CustomLossConfig.model_fields
    assert list(real) == [f.name for f in dataclasses.fields(CustomLossConfig)]
    assert real["type"].default == "custom"
    default = configs.DefaultLossConfig()
    assert {k: getattr(default, k) for k in PRIME_RL_DEFAULT_LOSS} == PRIME_RL_DEFAULT_LOSS
    # PRIME-RL's own loader imports our function from the example's [trainer.loss] and calls it.
    table = tomllib.loads(EXAMPLE.read_text())["trainer"]["loss"]
    rl_fn = loss.setup_rl_loss_fn(configs.CustomLossConfig(**table))
    lp = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    out = rl_fn(
        loss.LossInputs(lp, lp.detach(), None, torch.ones(3), torch.ones(3, dtype=torch.bool))
    )
    assert isinstance(out, loss.LossOutputs) and out.loss.dim() == 0


def prime_rl_import_object(dotted: str):
    """PRIME-RL 0.8's prime_rl.utils.utils.import_object rule: split at the last '.'."""
    module_path, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


def test_toml_example_wires_the_loss():
    config = tomllib.loads(EXAMPLE.read_text())
    table = config["trainer"]["loss"]
    custom = CustomLossConfig(**table)
    assert custom.type == "custom"
    assert prime_rl_import_object(custom.import_path) is loss_fn
    cfg = PrimeRLLossConfig.from_kwargs(custom.kwargs)
    assert cfg.mask == "both" and (cfg.log_ratio_low, cfg.log_ratio_high) == (-4.0, 4.0)
    assert cfg.dpo_variant == "simpo"
    # The rest of the file is PRIME-RL's GRPO setup: the algorithm ships advantages.
    assert config["orchestrator"]["algo"]["type"] == "grpo"


def test_prime_rl_calling_convention_with_the_example_kwargs():
    """Mirror of PRIME-RL 0.8's compute_loss: per-sample calls, summed, / global rl tokens."""
    kwargs = tomllib.loads(EXAMPLE.read_text())["trainer"]["loss"]["kwargs"]
    gen = torch.Generator().manual_seed(1)
    lengths = (5, 9, 3)
    params = [(-torch.rand(n, generator=gen) * 2).requires_grad_() for n in lengths]
    masks = [torch.rand(n, generator=gen) > 0.3 for n in lengths]
    total = params[0].sum() * 0.0
    metrics: dict[str, list[torch.Tensor]] = {}
    for lp, mask in zip(params, masks):
        inf = lp.detach() + 0.1 * torch.randn(lp.shape, generator=gen)
        adv = torch.full(lp.shape, float(torch.randn(1, generator=gen)))
        out = loss_fn(LossInputs(lp, inf, None, adv, mask), **kwargs)
        total = total + out.loss
        for k, v in out.metrics.items():
            metrics.setdefault(k, []).append(v)
    rl_scale = max(int(sum(m.sum() for m in masks)), 1)
    scaled = total / rl_scale
    scaled.backward()
    assert scaled.dim() == 0 and torch.isfinite(scaled)
    # Tokens outside the loss mask get no gradient; tokens inside do.
    for lp, mask in zip(params, masks):
        assert (lp.grad[~mask] == 0).all()
        assert (lp.grad[mask] != 0).any()
    # PRIME-RL stacks 0-dim metrics across samples: same keys, 0-dim, every call.
    assert all(len(v) == len(lengths) and v[0].dim() == 0 for v in metrics.values())
    torch.stack(metrics["is_masked"])
