"""The composition root's sequencing: everything that starts, watches and stops a run.

assembly/ builds the parts from the run configuration; here they run. `replica` is the process
each replica runs (`replica_training`: build, then train inside the outer loop of the run's
mode); `driver` launches the replicas through an executor from the backend registry, runs what
the outer-loop mode needs beside them (`synchronizer_process`, a torchft lighthouse), watches
them (`supervision`: restarts, departures, health) and gathers metrics (`metrics`), checkpoints
(`checkpoint`), status (`status`) and the report (`report`); `preflight` checks a run before
anything is written; `security` makes the run's signing keys; `chaos` runs and checks a run
under faults. The CLI (`composer_replication.cli`) sits on top of this package. The store
client is `exchange.store.ObjectStore`. Nothing heavy is imported here.
"""

from composer_replication.run.folder import RunFolder, default_run_name

__all__ = ["RunFolder", "default_run_name"]
