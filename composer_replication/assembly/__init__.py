"""Build every part of a run from its configuration; run/ starts, watches and stops them.

- `build`: the task, the model, the channel-3 teachers and the `ComposerReplicationTrainer` (the
  one config -> TRL translation);
- `outer`: the outer-loop mode (`OuterLoopMode`, picked by diloco's registry), a replica's
  outer loop (manager, learner, outer optimizer), the decoupled synchronizer, the torchft
  lighthouse;
- `screening`: the exchange's screening policy and loss probe of a run;
- `services`: the executor, a replica's heartbeat, the chaos injector and its S3 proxy.

Shared by the composition root (`run/`: replicas, the driver, the synchronizer's process,
`bake-traces`, preflight) and the recipes that drive the same parts through another framework
(`recipes/monarch`). Imports the component packages and `config`; only `run` and `recipes`
import it.
"""
