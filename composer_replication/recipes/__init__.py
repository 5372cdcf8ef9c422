"""Framework recipes: the composer loss inside other RL trainers (docs/recipes/).

- ``verl``: importing it registers the advantage estimator ``grpo_composer`` and the policy loss
  ``composer`` in verl 0.9's registries (extra ``verl``).
- ``prime_rl``: ``composer_loss.loss_fn``, a PRIME-RL 0.8 custom loss (no extra: the contract is
  mirrored, prime-rl itself is not a dependency).
- ``monarch``: a run as Monarch actors on a process mesh (`TrainerActor`, `GeneratorActor`,
  `RewarderActor`, `TeacherPoolActor`) and its driver ``python -m
  composer_replication.recipes.monarch.train CONFIG`` (extra ``monarch``).

Recipes call public APIs only (the loss library; the Monarch recipe also the assembly, trainer,
diloco and exchange building blocks) and nothing of ours imports them; importing this package
imports no framework.
"""
