"""What a driver and the replicas it launches agree on: environment variables, the stored run
config's key, exit codes.

- ``$COMPOSER_STORAGE_OPTIONS``: fsspec options of the run's store (JSON);
- ``$COMPOSER_RUN_GENERATION``: the run generation of the launch (exchange/fencing.py);
- ``run_config.json``: the resolved run configuration in the store;
- exit code `EXIT_FENCED` (3): a newer launch of the run fenced the replica;
- exit code `EXIT_NO_QUORUM` (4): a round can never commit (every rank judged, fewer than
  ``min_replicas`` valid; its refusals are in the replica's status and metrics), or its
  committed update is refused (unsigned runs' screening of global updates): the driver stops
  the run instead of restarting the replica.
"""

from __future__ import annotations

__all__ = [
    "CONFIG_KEY",
    "ENV_GENERATION",
    "ENV_STORAGE_OPTIONS",
    "EXIT_FENCED",
    "EXIT_NO_QUORUM",
    "EXIT_UNUSABLE",
]

ENV_STORAGE_OPTIONS = "COMPOSER_STORAGE_OPTIONS"
ENV_GENERATION = "COMPOSER_RUN_GENERATION"
CONFIG_KEY = "run_config.json"
EXIT_UNUSABLE = 2  # the arguments, the environment or the stored config cannot run a replica
EXIT_FENCED = 3
EXIT_NO_QUORUM = 4
