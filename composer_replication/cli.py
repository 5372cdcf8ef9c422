"""`composer-replication` (also `python -m composer_replication`): the command-line tool.

    composer-replication train [CONFIG.toml] [section.key=value ...]   train (default: the demo)
    composer-replication train --resume RUN [section.key=value ...]    continue a stopped run
    composer-replication report RUN                                    plots + summary.md
    composer-replication status RUN                                    replicas, round, health
    composer-replication config show [CONFIG] [overrides]              the resolved config
    composer-replication config validate [CONFIG ...] [overrides]      check configs (no run;
        --check-store, --check-backend: the store and the backend's credentials; --offline)
    composer-replication bake-traces [CONFIG] [overrides] --out FILE   record teacher traces
    composer-replication replica --rendezvous URI                      what each replica runs
    composer-replication synchronizer RUN_FOLDER_OR_URI                a decoupled run's synchronizer

Exit codes: 0 success, 1 the run failed, 2 a configuration or usage error (nothing written),
3 a round can never commit (fewer valid replicas than diloco.min_replicas), 130 interrupted.

Every example a `--help` shows is in EXAMPLES; tests/cli/test_cli_help_examples.py runs each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# Only the error type at import: the schema imports the loss library (torch), so `--help` and
# usage errors stay instant and each command imports what it needs.
from composer_replication.config import ConfigError

if TYPE_CHECKING:
    from composer_replication.config import RunConfig
    from composer_replication.run.folder import RunFolder

__all__ = ["main"]

PROG = "composer-replication"

CONFIG_HELP = (
    "a TOML config (default: the embedded CPU demo; see `config show`) followed by any number "
    "of section.key=value overrides (examples below)"
)

EXIT_CODES = (
    "exit codes: 0 ok, 1 the run failed, 2 configuration or usage error (nothing written), "
    "3 a round can never commit (fewer valid replicas than diloco.min_replicas), "
    "130 interrupted"
)

# The examples each command's --help shows (`composer-replication` and these arguments), in
# order. tests/cli/test_cli_help_examples.py runs every one: `config` ones as they are, `train`
# and `bake-traces` ones through the checks `train` runs before it writes anything.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "train": (
        "train",
        "train train.max_steps=100 diloco.sync_every_h=10 backend.n_replicas=4",
        "train examples/gpu_qwen05b.toml",
        "train examples/cpu_default.toml run.seed=1 --name seed-1",
    ),
    "config show": (
        "config show",
        "config show examples/modal_s3.toml backend.n_replicas=8",
    ),
    "config validate": (
        "config validate examples/cpu_default.toml examples/gpu_qwen05b.toml --offline",
        "config validate examples/cpu_default.toml train.max_steps=300",
    ),
    "bake-traces": ("bake-traces --out traces.jsonl --limit 8",),
}


def _epilog(command: str, *extra: str) -> str:
    lines = ["examples:", *(f"  {PROG} {e}" for e in EXAMPLES[command])]
    return "\n".join([*lines, "", *extra])


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's own, except that a text starting with "examples:" keeps its lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            head, _, tail = text.partition("\n\n")
            filled = super()._fill_text(tail, width, indent) if tail else ""
            return "\n".join(indent + line for line in head.splitlines()) + (
                "\n\n" + filled if filled else ""
            )
        return super()._fill_text(text, width, indent)


def _split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.toml] [overrides...] -> (config path or None, overrides)."""
    args = list(args)
    path = None
    if args and "=" not in args[0]:
        path = args.pop(0)
    bad = [a for a in args if "=" not in a]
    if bad:
        raise ConfigError(
            f"unexpected argument {bad[0]!r}: after the config file only section.key=value "
            "overrides are allowed"
        )
    return path, args


def _load(args: Sequence[str]) -> RunConfig:
    from composer_replication.config import load_config

    path, overrides = _split_config_args(args)
    return load_config(path, overrides)


# ----------------------------------------------------------------------------- commands


def cmd_train(ns: argparse.Namespace) -> int:
    from composer_replication.run import driver

    if ns.resume:
        if ns.overwrite:
            raise ConfigError("--resume and --overwrite cannot be combined")
        path, overrides = _split_config_args(ns.args)
        if path is not None:
            raise ConfigError(
                f"--resume uses the run's stored config; drop {path!r} (overrides are allowed)"
            )
        done = driver.finished_already(ns.resume, overrides)
        if done is not None:
            print(done)
            return 0
        config, folder = driver.prepare_resume(ns.resume, overrides)
        result = driver.run(config, folder, resume=True)
    else:
        config = _load(ns.args)
        config, folder = driver.prepare(config, overwrite=ns.overwrite, name=ns.name)
        result = driver.run(config, folder, overwrite=ns.overwrite)
    return result.exit_code


def _run_folder(run: str) -> RunFolder:
    from composer_replication.run.driver import resolve_run_folder

    folder = resolve_run_folder(run)
    if not folder.is_run():
        raise ConfigError(f"{folder.root} is not a run folder (no config.json in it)")
    return folder


def cmd_report(ns: argparse.Namespace) -> int:
    import importlib.util

    from composer_replication.run.report import headline_lines, write_report
    from composer_replication.run.security import secret_files, secrets_warning

    folder = _run_folder(ns.run)
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("report needs matplotlib: `pip install composer-replication[report]`")
    summary, plots = write_report(folder)
    for plot in plots:
        print(f"wrote {plot}")
    print(f"wrote {folder.summary}")
    # The headline numbers `train` printed at the end: reward, held-out accuracy, losses.
    print(f"Run {folder.name}:")
    print("\n".join(headline_lines(summary)))
    secrets = secret_files(folder.root)
    if secrets:
        print(f"{PROG}: warning: {secrets_warning(folder.root, secrets)}", file=sys.stderr)
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from composer_replication.run.status import run_status, status_text

    info = run_status(_run_folder(ns.run), stale_after_s=ns.stale_after)
    print(json.dumps(info, indent=1) if ns.json else status_text(info))
    return 0


def _split_configs(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """[CONFIG.toml ...] [overrides...] -> (config paths, overrides)."""
    args = list(args)
    split = next((i for i, a in enumerate(args) if "=" in a), len(args))
    paths, overrides = args[:split], args[split:]
    bad = [a for a in overrides if "=" not in a]
    if bad:
        raise ConfigError(
            f"unexpected argument {bad[0]!r}: after the config files only section.key=value "
            "overrides are allowed"
        )
    return paths, overrides


def _validate(
    config: RunConfig, check_store: bool, *, check_backend: bool = False, offline: bool = False
) -> str:
    """Run the pre-flight checks a `train` would run (nothing written); the "ok: ..." line.
    `check_backend`: also build the executor (its credentials); `offline`: skip the hub check."""
    from composer_replication.run import preflight

    preflight.check_model(config, hub=not offline)
    preflight.check_task(config)
    preflight.check_teachers(config)
    preflight.check_store_scheme(config.store.uri)
    store_uri = config.store.uri or "file:///tmp/composer-replication-validate/"
    preflight.check_backend(config, store_uri)
    notes = []
    if check_backend:
        notes.append(preflight.check_backend_credentials(config))
    if check_store and config.store.uri:
        preflight.check_store(config, config.store.uri, overwrite=True)
        notes.append("store writable")
    if offline and not config.model.is_tiny and "/" in config.model.name:
        if not Path(config.model.name).expanduser().exists():
            notes.append("hub model not checked: offline")
    return (
        f"ok: {config.backend.n_replicas} x {config.backend.kind} replicas, model "
        f"{config.model.name}, task {config.task.name}, {config.train.max_steps} inner steps, "
        f"{config.n_rounds} outer rounds" + (f" ({'; '.join(notes)})" if notes else "")
    )


def cmd_config(ns: argparse.Namespace) -> int:
    from composer_replication.config import dump_toml, load_config, to_dict

    if ns.config_command == "show":
        config = _load(ns.args)
        if not ns.json and not _split_configs(ns.args)[0]:  # the embedded default: say how
            from composer_replication.config.reference import embedded_differences_comment

            print(embedded_differences_comment(), end="")  # it differs from a TOML file's
        print(json.dumps(to_dict(config), indent=1) if ns.json else dump_toml(config), end="")
        if ns.json:
            print()
        return 0
    from composer_replication.run.preflight import hub_offline

    paths, overrides = _split_configs(ns.args)
    checks = {"check_backend": ns.check_backend, "offline": ns.offline or hub_offline()}
    if len(paths) <= 1:
        config = load_config(paths[0] if paths else None, overrides)
        print(_validate(config, ns.check_store, **checks))
        return 0
    # Several files (`config validate examples/*.toml`): each checked on its own, the
    # overrides applied to every one; exit 2 when any fails.
    failed = 0
    for path in paths:
        try:
            line = _validate(load_config(path, overrides), ns.check_store, **checks)
            print(f"{path}: {line}", flush=True)
        except ConfigError as exc:
            failed += 1
            print(f"{PROG}: error: {path}: {exc}", file=sys.stderr, flush=True)
    if failed:
        print(f"{PROG}: {failed} of {len(paths)} configs failed", file=sys.stderr)
        return 2
    return 0


def cmd_bake_traces(ns: argparse.Namespace) -> int:
    from composer_replication.run.bake import bake

    config = _load(ns.args)
    out = Path(ns.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out: folder {out.parent} does not exist")
    if out.exists() and not out.is_file():
        raise ConfigError(f"--out {out} is not a file")
    if out.exists() and ns.overwrite:
        out.unlink()
    elif out.exists():  # resume: prompts already baked are skipped, the rest appended
        print(f"resuming {out}: prompts that already have traces are skipped", flush=True)
    count = bake(config, out, split=ns.split, limit=ns.limit)
    print(f"wrote {count} new traces to {out}")
    return 0


def cmd_replica(ns: argparse.Namespace) -> int:
    from composer_replication.run import replica

    argv = []
    if ns.rendezvous:
        argv += ["--rendezvous", ns.rendezvous]
    if ns.rank is not None:
        argv += ["--rank", str(ns.rank)]
    return int(replica.main(argv) or 0)


def cmd_synchronizer(ns: argparse.Namespace) -> int:
    from composer_replication.run import synchronizer_process

    argv = [ns.run] + (["--storage-options", ns.storage_options] if ns.storage_options else [])
    return int(synchronizer_process.main(argv) or 0)


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train LLM agents with the Composer recipe (GRPO + hint self-distillation "
        "+ trace replay) on N replicas kept in step by DiLoCo.",
        epilog="Run `composer-replication train` with no arguments for the CPU demo. "
        + EXIT_CODES
        + ".",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "train",
        help="run a training run (no arguments: the embedded CPU demo)",
        description="Train with the three-channel composer loss on N DiLoCo replicas. With no "
        "arguments: a tiny model, a built-in task, 2 local replicas, DiLoCo through file:// "
        "under ./runs/<name>/ (a few minutes on a laptop CPU, no network).",
        epilog=_epilog("train", EXIT_CODES + "."),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG.toml] [section.key=value]", help=CONFIG_HELP)
    p.add_argument(
        "--resume",
        metavar="RUN",
        help="continue RUN (a run folder or a name under "
        "runs/) from its last committed outer round",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    p.add_argument("--name", help="run name (same as run.name=...)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "report",
        help="draw plots and a markdown summary of a run",
        description="Write <run>/plots/*.png and <run>/summary.md from the run's metrics.",
    )
    p.add_argument("run", metavar="RUN", help="run folder (or its name under runs/)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "status",
        help="replicas, outer round, lag and health of a run",
        description="Show each replica's state, step, outer round, lag and "
        "health (works while the run is going).",
    )
    p.add_argument("run", metavar="RUN", help="run folder (or its name under runs/)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--stale-after",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="a running replica silent this long is 'stale' (default 120)",
    )
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "config",
        help="show or validate a configuration",
        description="Print the resolved configuration or check it.",
    )
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    q = csub.add_parser(
        "show",
        help="print the resolved config (TOML)",
        description="Print the resolved configuration: defaults, file, overrides.",
        epilog=_epilog("config show"),
        formatter_class=_HelpFormatter,
    )
    q.add_argument("args", nargs="*", metavar="[CONFIG.toml] [section.key=value]", help=CONFIG_HELP)
    q.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    q.set_defaults(func=cmd_config)
    q = csub.add_parser(
        "validate",
        help="check configs without running them",
        description="Check types, keys, model path, task, store scheme and backend of each "
        "config given (the overrides apply to every one), as `train` checks them before it "
        "writes anything; exit 2 with a message when something is wrong.",
        epilog=_epilog("config validate"),
        formatter_class=_HelpFormatter,
    )
    q.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG.toml ...] [section.key=value]",
        help="any number of TOML configs (none: the embedded demo) followed by "
        "section.key=value overrides applied to each",
    )
    q.add_argument(
        "--check-store",
        action="store_true",
        help="also probe that store.uri is writable (writes and deletes one object)",
    )
    q.add_argument(
        "--check-backend",
        action="store_true",
        help="also build the backend's executor as `train` would, without launching anything: "
        "its credentials must be there (kubeconfig, Modal token, HF token, AWS credentials)",
    )
    q.add_argument(
        "--offline",
        action="store_true",
        help="skip the check that a hub model is cached or reachable (also when "
        "HF_HUB_OFFLINE=1 is set)",
    )
    q.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "bake-traces",
        help="record teacher traces ahead of training",
        description="Run the configured teachers (or the task oracle) on the "
        "task's prompts and write trace JSONL for teachers.traces_path.",
        epilog=_epilog("bake-traces"),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG.toml] [section.key=value]", help=CONFIG_HELP)
    p.add_argument("--out", required=True, help="output JSONL file")
    p.add_argument("--split", choices=("train", "eval"), default="train", help="prompts to use")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start --out afresh (default: resume it, asking only for prompts that "
        "have no trace yet)",
    )
    p.set_defaults(func=cmd_bake_traces)

    p = sub.add_parser(
        "replica",
        help="run one replica (what executors launch)",
        description="Run one DiLoCo replica: read the run config from the store, "
        "train, synchronise, report. Rank from REPLICA_RANK (or --rank).",
    )
    p.add_argument("--rendezvous", help="store URI of the run (default: $DILOCO_RENDEZVOUS)")
    p.add_argument("--rank", type=int, default=None, help="replica rank (default: $REPLICA_RANK)")
    p.set_defaults(func=cmd_replica)

    p = sub.add_parser(
        "synchronizer",
        help="run a decoupled run's synchronizer",
        description="Merge the learners' fragment pushes of a run with "
        "diloco.mode = 'decoupled' (the driver runs one itself unless "
        "diloco.synchronizer = 'external'). Several may run: a lease in the "
        "store keeps one active, the others take over when it dies.",
    )
    p.add_argument("run", metavar="RUN_FOLDER_OR_URI", help="run folder or the run's store URI")
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options (default: $COMPOSER_STORAGE_OPTIONS or the run's)",
    )
    p.set_defaults(func=cmd_synchronizer)
    return parser


def _version() -> str:
    from composer_replication import __version__

    return f"{PROG} {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after options (`train --name x train.max_steps=20`): argparse leaves
    # such positionals unparsed, so they are appended to the command's own arguments here.
    ns, extra = parser.parse_known_args(list(argv) if argv is not None else None)
    if extra:
        takes_overrides = "args" in vars(ns)  # the commands with [CONFIG] [overrides...]
        if not takes_overrides or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        ns.args = [*ns.args, *extra]
    try:
        return int(ns.func(ns) or 0)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
