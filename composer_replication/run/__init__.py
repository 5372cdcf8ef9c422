"""The composition root: everything that knows the run configuration.

`build` turns the configuration into a task, a model, teachers and a trainer; `replica` is the
process each replica runs (build, then train inside the DiLoCo outer loop); `driver` launches the
replicas through an executor from the backend registry and gathers metrics (`metrics`),
checkpoints (`checkpoint`), status (`status`) and the report (`report`); `preflight` checks a
run before anything is written; `screening` builds the exchange's screening policy and loss
probe, `security` the run's signing keys. The CLI (`composer_replication.cli`) sits on top of this
package. The store client is `exchange.store.ObjectStore`.
Nothing heavy is imported here.
"""

from composer_replication.run.folder import RunFolder, default_run_name

__all__ = ["RunFolder", "default_run_name"]
