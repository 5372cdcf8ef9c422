"""VeRL recipe (verl 0.9, extra ``verl``): importing this package registers, in verl's own
registries, the advantage estimator ``grpo_composer`` and the policy loss ``composer``.

- ``advantage``: ``grpo_composer_advantage``, verl's GRPO outcome advantage.
- ``policy_loss``: ``composer_policy_loss`` (the three channels over verl's log-probs, through
  ``loss.combine`` / ``loss.grpo_loss``), the DataProto keys of channels 2 and 3, and
  ``composer_ppo_loss``, verl's actor loss function with those keys passed through.

Select them with ``algorithm.adv_estimator=grpo_composer`` and
``actor_rollout_ref.actor.policy_loss.loss_mode=composer``; in Ray workers set
``VERL_USE_EXTERNAL_MODULES=composer_replication.recipes.verl`` so each worker imports (and so
registers) them too. Registration is idempotent: importing again, or calling ``register()``
again, is a no-op; a *different* function already registered under either name is a ValueError.
See docs/recipes/verl.md.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from verl.trainer.ppo import core_algos
except ImportError as exc:  # pragma: no cover - exercised where the extra is absent
    raise ImportError(
        "composer_replication.recipes.verl needs verl 0.9: pip install 'composer-replication[verl]'"
    ) from exc

from composer_replication.recipes.verl.advantage import grpo_composer_advantage
from composer_replication.recipes.verl.policy_loss import (
    BATCH_KEYS,
    composer_policy_loss,
    composer_ppo_loss,
)

ADV_ESTIMATOR = "grpo_composer"
POLICY_LOSS = "composer"


def _same(a: object, b: object) -> bool:
    # A re-executed module (importlib.reload, a second import path) makes new function objects;
    # the same qualified name is the same function for registration purposes.
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def _registered(lookup: Callable[[str], object], name: str) -> object:
    try:
        return lookup(name)
    except ValueError:  # verl's "unknown name" error
        return None


def register() -> None:
    """Register ``grpo_composer`` and ``composer`` in verl's registries (idempotent)."""
    for name, fn, lookup, decorator in (
        (
            ADV_ESTIMATOR,
            grpo_composer_advantage,
            core_algos.get_adv_estimator_fn,
            core_algos.register_adv_est,
        ),
        (
            POLICY_LOSS,
            composer_policy_loss,
            core_algos.get_policy_loss_fn,
            core_algos.register_policy_loss,
        ),
    ):
        current = _registered(lookup, name)
        if current is fn:
            continue
        if current is not None and not _same(current, fn):
            raise ValueError(
                f"verl already has a different function registered as {name!r} "
                f"({getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', '?')}); "
                "the composer recipe needs that name"
            )
        if current is not None:
            # Our own function from an earlier execution of this module: verl's register_adv_est
            # refuses to replace an entry, so keep the existing one (same code).
            continue
        # The tuple mixes two registries whose decorators are typed for their own signatures.
        decorator(name)(fn)  # type: ignore[arg-type]


register()

__all__ = [
    "ADV_ESTIMATOR",
    "BATCH_KEYS",
    "POLICY_LOSS",
    "composer_policy_loss",
    "composer_ppo_loss",
    "grpo_composer_advantage",
    "register",
]
