"""Framework recipes: the composer loss inside other RL trainers (docs/recipes/).

- ``verl``: importing it registers the advantage estimator ``grpo_composer`` and the policy loss
  ``composer`` in verl 0.9's registries (extra ``verl``).
- ``prime_rl``: ``composer_loss.loss_fn``, a PRIME-RL 0.8 custom loss (no extra: the contract is
  mirrored, prime-rl itself is not a dependency).

Recipes call the loss library's public API only and nothing of ours imports them; importing this
package imports no framework.
"""
