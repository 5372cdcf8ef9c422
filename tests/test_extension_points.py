"""The recipes of ARCHITECTURE.md, "Where to add", followed to the letter.

Each test writes a toy extension into a module of its own (in ``tmp_path``, imported from
there), makes the one registration its recipe names (the registry entry, patched for the test's
duration), and uses it by name from a TOML run config through the real loading and assembly
path. A recipe that goes stale (a second list to edit, a name the loader does not accept, an
import that fails) fails here.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from composer_replication.assembly import build, services
from composer_replication.assembly.outer import outer_loop_mode
from composer_replication.config import ConfigError, RunConfig, load_config
from composer_replication.diloco import mode_registry
from composer_replication.diloco.mode_protocol import ReplicaContext
from composer_replication.exchange import codecs, rules, schemes
from composer_replication.exchange.codec_blocks import NoConfig
from composer_replication.exchange.store import ObjectStore
from composer_replication.executors import registry
from composer_replication.loss import combine, sdpo_wrappers
from composer_replication.run.preflight import check_store_scheme
from composer_replication.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]

# recipe (its first words in ARCHITECTURE.md) -> the file and registry its test registers in
REGISTRATIONS = {
    "An aggregation rule (tested)": ("exchange/rules.py", "_REGISTRY"),
    "A codec (tested)": ("exchange/codecs.py", "_REGISTRY"),
    "An executor backend (tested)": ("executors/registry.py", "BACKENDS"),
    "A store scheme (tested)": ("exchange/schemes.py", "SCHEMES"),
    "A task (tested)": ("tasks/__init__.py", "TASKS"),
    "An outer-loop mode (tested)": ("diloco/mode_registry.py", "_MODES"),
    "An SDPO wrapper (tested)": ("loss/sdpo_wrappers.py", "_REGISTRY"),
}


def _recipes() -> dict[str, str]:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Where to add", 1)[1].split("\n## ", 1)[0]
    bullets = ["- " + b for b in section.split("\n- ")[1:]]
    return {b[2:].split(":", 1)[0]: " ".join(b.split()) for b in bullets}


@pytest.mark.parametrize("recipe", sorted(REGISTRATIONS))
def test_each_tested_recipe_names_the_registration_its_test_makes(recipe: str) -> None:
    path, name = REGISTRATIONS[recipe]
    text = _recipes()[recipe]
    assert f"`{path}`" in text and name in text, text
    assert (ROOT / "composer_replication" / path).exists()


def _toy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Any:
    """Import ``source`` as module ``name`` from ``tmp_path`` (forgotten after the test)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module: ModuleType = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _config(tmp_path: Path, toml: str) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(toml), encoding="utf-8")
    return load_config(path)


def _one_round(config: RunConfig, store_uri: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every replica of ``config`` (threads) through one outer round of the outer-loop mode the
    config names, built by assembly/, meeting in ``store_uri``; rank -> its global weights after
    the round."""
    n, h = config.backend.n_replicas, config.diloco.sync_every_h
    mode = outer_loop_mode(config)
    out: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def replica(rank: int) -> None:
        try:
            with lock:  # the model factory seeds torch's global RNG
                torch.manual_seed(0)
                model = nn.Linear(4, 3)
            ctx = ReplicaContext(
                store=ObjectStore(str(store_uri), config.store.storage_options),
                rank=rank,
                n_replicas=n,
                keep_rounds=4,
                model=model,
            )
            loop = mode.build_learner(ctx)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            outer = loop.outer.bind(model=model, optimizer=opt)
            g = torch.Generator().manual_seed(rank)
            with outer:
                for _ in range(h):
                    opt.zero_grad()
                    model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
                    opt.step()
            out[rank] = outer.global_parameters()
            loop.close()
        except BaseException as e:  # surfaced in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


# ----------------------------------------------------------------------- an aggregation rule

RULE = """
    from composer_replication.exchange.merge_arithmetic import coordinatewise
    from composer_replication.exchange.rules import UnscaledRule

    CALLS = []


    class MinRule(UnscaledRule):  # no trim, no clip scales: UnscaledRule's members
        def combine(self, operands, trim):
            tensors = [op.decode() for op in operands]
            CALLS.append(len(tensors))
            return coordinatewise(tensors, lambda n: (0, 0))  # each coordinate's smallest
"""


def test_an_aggregation_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _toy_module(tmp_path, monkeypatch, "toy_rule", RULE)
    monkeypatch.setitem(rules._REGISTRY, "toy_min", "toy_rule:MinRule")  # the registration
    config = _config(
        tmp_path,
        """
        [diloco]
        sync_every_h = 2
        aggregate = "toy_min"
        aggregate_outlier_ratio = 0
        [backend]
        n_replicas = 2
        """,
    )
    assert config.diloco.exchange.aggregate == "toy_min"
    merged = _one_round(config, tmp_path / "store")
    assert toy.CALLS == [2, 2]  # each replica merged both contributions with the toy rule
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
    with pytest.raises(ConfigError, match=r"diloco.aggregate: .*'toy_mni'.*did you mean 'toy_min'"):
        _config(tmp_path, '[diloco]\naggregate = "toy_mni"\n')


# ----------------------------------------------------------------------------------- a codec

CODEC = """
    import torch

    from composer_replication.exchange.codec_blocks import DenseCodec

    NAME = "fp16"
    ENCODED = []


    class Fp16Codec(DenseCodec):
        name = NAME

        def layout(self, numel):
            return {"q": (torch.float16, (numel,))}

        def encode(self, t):
            ENCODED.append(t.numel())
            return {"q": t.detach().reshape(-1).to("cpu", torch.float32).to(torch.float16)}

        def decode_pass(self, parts, out_numel):
            q = parts["q"]

            def run(b0, b1, e0, e1, dst):
                dst.copy_(q[e0:e1])

            return run

        def max_abs_error_bound(self, t):
            x = t.detach().reshape(-1).to("cpu", torch.float32)
            return x.abs() * 2.0**-11
"""


def test_a_codec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _toy_module(tmp_path, monkeypatch, "toy_codec", CODEC)
    entry = codecs._Entry(NoConfig, toy.Fp16Codec)
    monkeypatch.setitem(codecs._REGISTRY, toy.NAME, entry)  # the registration
    x = torch.randn(5000)
    got = codecs.decode(codecs.encode(x, "fp16"), "fp16", x.numel())
    assert bool(((got - x).abs() <= codecs.max_abs_error_bound(x, "fp16")).all())
    config = _config(
        tmp_path,
        """
        [diloco]
        sync_every_h = 2
        codec = "fp16"
        [backend]
        n_replicas = 2
        """,
    )
    merged = _one_round(config, tmp_path / "store")
    assert len(toy.ENCODED) >= 2 * 2  # each replica encoded its weight and its bias
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])


# ------------------------------------------------------------------- an executor backend

BACKEND = """
    import time

    from composer_replication.executors.executor import ReplicaHandle, ReplicaStatus


    class EchoExecutor:
        backend = "echo"

        def __init__(self, *, log_dir=None, greeting="hello"):
            self.log_dir, self.greeting, self.launched = log_dir, greeting, []

        def launch_replicas(self, n_replicas, entrypoint, entrypoint_args=None, *, env=None,
                            resources=None, secrets=None):
            self.launched.append((n_replicas, entrypoint))
            return [ReplicaHandle(r, self.backend, f"echo-{r}", ReplicaStatus.RUNNING,
                                  start_time=time.time()) for r in range(n_replicas)]

        def poll(self, handles):
            for h in handles:
                h.status, h.exit_code = ReplicaStatus.SUCCEEDED, 0
            return handles

        def collect(self, handles, timeout):
            return self.poll(handles)

        def cancel(self, handles):
            for h in handles:
                h.status = ReplicaStatus.CANCELLED

        def logs(self, handle, tail=None):
            return f"{self.greeting} from replica {handle.replica_id}"
"""


def test_an_executor_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _toy_module(tmp_path, monkeypatch, "toy_backend", BACKEND)
    entry = registry.Backend(  # the registration
        name="echo",
        module="toy_backend",
        cls="EchoExecutor",
        extra=None,
        sdk=None,
        remote=False,
        takes_log_dir=True,
        takes_resources=False,
        forward_env_as_secrets=False,
        summary="replicas that only say hello",
    )
    monkeypatch.setitem(registry.BACKENDS, "echo", entry)
    config = _config(
        tmp_path,
        """
        [backend]
        kind = "echo"
        n_replicas = 2
        options = { greeting = "hi" }
        """,
    )
    executor = services.build_executor(config, tmp_path / "logs")
    assert executor.backend == "echo"
    handles = executor.collect(executor.launch_replicas(2, "python -c pass"), timeout=1.0)
    assert [h.status.done for h in handles] == [True, True]
    assert executor.logs(handles[1]) == "hi from replica 1"
    assert executor.log_dir == str(tmp_path / "logs")


# ------------------------------------------------------------------------------------ a task

TASK = """
    import random

    from composer_replication.tasks import Task, Verdict, clean_completion


    class ParityTask(Task):
        name = "parity"

        def __init__(self, *, seed=0, n_train=256, n_eval=64, high=999):
            super().__init__(seed=seed, n_train=n_train, n_eval=n_eval)
            self.high = high

        def _sample(self, rng: random.Random):
            n = rng.randint(0, self.high)
            return f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd", {"n": n}

        def verify(self, example, completion):
            text = clean_completion(completion).lower()
            if text == example.answer:
                return Verdict(1.0, True, None)
            return Verdict(0.0, False, "answer 'even' or 'odd'")
"""


def test_a_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _toy_module(tmp_path, monkeypatch, "toy_task", TASK)
    monkeypatch.setitem(TASKS, "parity", toy.ParityTask)  # the registration
    config = _config(
        tmp_path,
        """
        [task]
        name = "parity"
        n_train = 16
        n_eval = 4
        options = { high = 99 }
        """,
    )
    task = build.build_task(config)
    assert isinstance(task, toy.ParityTask) and task.high == 99
    rows = task.to_dataset("train")
    assert len(rows) == 16
    example = task.train_examples()[0]
    assert task.verify(example, example.answer).correct
    assert not task.verify(example, "maybe").correct


# ----------------------------------------------------------------------------- a store scheme

SCHEME = """
    import threading

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem


    class ToyFileSystem(MemoryFileSystem):
        \"\"\"An in-memory server whose create refuses an existing key (a conditional PUT).\"\"\"

        protocol = ("toyfs",)
        store = {}  # its own objects, not memory://'s
        pseudo_dirs = [""]
        lock = threading.Lock()
        creates = 0

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("toyfs://"))

        def pipe_file(self, path, value, mode="overwrite", **kwargs):
            with self.lock:
                if mode == "create":
                    type(self).creates += 1
                return super().pipe_file(path, value, mode=mode, **kwargs)


    fsspec.register_implementation("toyfs", ToyFileSystem, clobber=True)
"""


def test_a_store_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _toy_module(tmp_path, monkeypatch, "toy_scheme", SCHEME)
    monkeypatch.setitem(schemes.SCHEMES, "toyfs", schemes.Scheme(run_store=True))  # registration
    config = _config(
        tmp_path,
        """
        [diloco]
        sync_every_h = 2
        [backend]
        n_replicas = 2
        [store]
        uri = "toyfs://bucket/runs/toy"
        """,
    )
    check_store_scheme(config.store.uri)  # what `train` and `config validate` check
    store = ObjectStore(config.store.uri, config.store.storage_options)
    assert store.put_if_absent("a", b"1") and not store.put_if_absent("a", b"2")
    assert bytes(store.get("a") or b"") == b"1" and store.list("") == ["a"]
    merged = _one_round(config, store.child_uri("exchange"))
    assert toy.ToyFileSystem.creates > 2  # the round's contributions and commit record
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
    monkeypatch.delitem(schemes.SCHEMES, "toyfs")
    with pytest.raises(ConfigError, match="toyfs://"):
        check_store_scheme(config.store.uri)


# ------------------------------------------------------------------------- an outer-loop mode

MODE = """
    from composer_replication.diloco.sync.sync_mode import SyncDiLoCo

    BUILT = []


    class EchoSync(SyncDiLoCo):  # sync DiLoCo under its own name, counting the learners built
        mode = "echo_sync"
        manager = "object_store"

        def build_learner(self, ctx):
            BUILT.append(ctx.rank)
            return super().build_learner(ctx)
"""


def test_an_outer_loop_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _toy_module(tmp_path, monkeypatch, "toy_mode", MODE)
    key = ("echo_sync", "object_store")
    monkeypatch.setitem(mode_registry._MODES, key, "toy_mode:EchoSync")  # the registration
    config = _config(
        tmp_path,
        """
        [diloco]
        mode = "echo_sync"
        sync_every_h = 2
        [backend]
        n_replicas = 2
        """,
    )
    assert isinstance(outer_loop_mode(config), toy.EchoSync)
    merged = _one_round(config, tmp_path / "store")
    assert sorted(toy.BUILT) == [0, 1]
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
    with pytest.raises(ConfigError, match=r"diloco.mode: .*'echo_snyc'.*did you mean 'echo_sync'"):
        _config(tmp_path, '[diloco]\nmode = "echo_snyc"\n')
    # a class whose names disagree with its registration is refused, naming both
    monkeypatch.setitem(mode_registry._MODES, ("other", "object_store"), "toy_mode:EchoSync")
    with pytest.raises(TypeError, match="make its names and its _MODES entry agree"):
        mode_registry.outer_loop_modes()


# ----------------------------------------------------------------------------- an SDPO wrapper

WRAPPER = """
    from composer_replication.loss.distill import generalized_jsd
    from composer_replication.loss.sdpo_wrappers import PlainWrapper

    CALLS = []


    class DoubleJsd(PlainWrapper):  # no rule, schedule or per-step metric: PlainWrapper's
        def divergence(self, s, student, teacher, token_mask):
            CALLS.append(tuple(student.shape))
            loss, _ = generalized_jsd(
                student, teacher, beta=s.sdpo_jsd_beta, temperature=s.sdpo_temperature,
                mask=token_mask,
            )
            return 2.0 * loss, {"double/half": float(loss.detach())}
"""


def _jsd_reference(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> float:
    """Jensen-Shannon divergence (beta 0.5) per token, in float64, the mean over ``mask``."""
    p, q = student.double().softmax(-1), teacher.double().softmax(-1)
    m = (p + q) / 2
    per_token = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    return float(per_token[mask].mean())


def test_an_sdpo_wrapper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _toy_module(tmp_path, monkeypatch, "toy_wrapper", WRAPPER)
    monkeypatch.setattr(sdpo_wrappers, "_BUILT", {})  # no instance of another test's toy
    monkeypatch.setitem(sdpo_wrappers._REGISTRY, "double_jsd", "toy_wrapper:DoubleJsd")
    config = _config(
        tmp_path,
        """
        [loss]
        sdpo_wrapper = "double_jsd"
        alpha_sdpo = 0.5
        sdpo_jsd_beta = 0.5
        beta_replay = 0
        """,
    )
    assert config.loss.sdpo_wrapper == "double_jsd"
    g = torch.Generator().manual_seed(0)
    b, t, v = 3, 5, 11
    student, teacher = torch.randn(b, t, v, generator=g), torch.randn(b, t, v, generator=g)
    completion_mask = torch.ones(b, t, dtype=torch.bool)
    completion_mask[1, 3:] = False
    sdpo_mask = torch.tensor([True, True, False])
    logps = torch.randn(b, t, generator=g)
    kwargs = config.loss.compose_kwargs()  # the [loss] section as compose_loss keywords
    total, metrics = combine(
        per_token_logps=logps,
        completion_mask=completion_mask,
        advantages=torch.tensor([1.0, -1.0, 0.5]),
        student_logits=student,
        teacher_logits=teacher,
        sdpo_mask=sdpo_mask,
        **kwargs,
    )
    assert toy.CALLS == [(b, t, v)]
    jsd = _jsd_reference(student, teacher, completion_mask & sdpo_mask[:, None])
    assert metrics["double/half"] == pytest.approx(jsd, rel=1e-5)
    assert metrics["loss/sdpo"] == pytest.approx(2 * jsd, rel=1e-5)
    assert float(total) == pytest.approx(metrics["loss/grpo"] + 0.5 * 2 * jsd, rel=1e-5)
    assert "taid/t" not in metrics
    with pytest.raises(ConfigError, match=r"loss.sdpo_wrapper: .*did you mean 'double_jsd'"):
        _config(tmp_path, '[loss]\nsdpo_wrapper = "double_jsb"\n')
