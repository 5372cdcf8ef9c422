"""Build a run's parts from its configuration: the task, the model, the channel-3 teachers and
the `ComposerReplicationTrainer` (`assembly/build.py`).

Shared by the composition root (`run/`: replicas, `bake-traces`, preflight) and the recipes that
drive the same parts through another framework (`recipes/monarch`), so there is one
config -> trainer translation. Imports `config`, `tasks`, `models`, `trainer` and `data` only;
only `run` and `recipes` import it.
"""
