"""diloco_replica.py: what each of the N DiLoCo replicas runs (seed Recipe 4, runnable offline).

Launched by examples/diloco_driver.py (or any ServerlessExecutor) with REPLICA_RANK, WORLD_SIZE
and DILOCO_RENDEZVOUS in the environment; S3/GCS options come as JSON in
COMPOSER_STORAGE_OPTIONS (for example ``{"endpoint_url": "http://127.0.0.1:8333"}``).

The inner trainer is Recipe 1's ComposerReplicationTrainer on the tiny built-in model (no
download); the DiLoCo wiring below is the seed's, line for line: ``trainer.optimizer`` is still
None here, so the outer loop binds to it when training starts (in the callback's
on_train_begin), after loading the run's global weights from the store.

    python examples/diloco_replica.py --steps 8 --sync-every-h 4    # with the env vars above
"""

from __future__ import annotations

import argparse
import json
import os

from composer_replication.diloco import make_diloco_outer_loop
from composer_replication.diloco.serverless import (
    AllReduceConfig,
    MockManager,
    ObjectStoreAllReduce,
)


def build_trainer(rank: int, steps: int, out_dir: str):  # noqa: ANN201 - example
    """Recipe 1's trainer on the tiny local model and an arithmetic prompt set."""
    from datasets import Dataset

    from composer_replication import ComposerReplicationTrainer
    from composer_replication.models import build_tiny_model, build_tokenizer
    from composer_replication.trainer import ComposerConfig

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    pairs = [(a, b) for a in range(1, 6) for b in range(1, 6)]
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )

    def reward_exact(completions, answer, **_):  # noqa: ANN001, ANN202
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if t.strip().startswith(a) else 0.0 for t, a in zip(texts, answer)]

    args = ComposerConfig(
        output_dir=out_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=rank,  # each replica sees its own data order
        disable_tqdm=True,
    )
    return ComposerReplicationTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward_exact],
        train_dataset=dataset,
        args=args,
        alpha_sdpo=0.1,
        beta_replay=0.05,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rendezvous", default=None, help="store URI (default: $DILOCO_RENDEZVOUS)")
    ap.add_argument("--rank_env", default="REPLICA_RANK", help="variable holding the rank")
    ap.add_argument("--steps", type=int, default=8, help="inner steps per replica")
    ap.add_argument("--sync-every-h", type=int, default=4, help="H: inner steps per round")
    ap.add_argument("--timeout", type=float, default=600.0, help="step timeout (seconds)")
    a = ap.parse_args()
    rank = int(os.environ[a.rank_env])
    uri = a.rendezvous or os.environ["DILOCO_RENDEZVOUS"]
    world_size = int(os.environ.get("WORLD_SIZE", "4"))
    trainer = build_trainer(rank, a.steps, os.path.join("runs", "diloco-example", f"rank{rank}"))

    # ---- the seed's Recipe 4 replica wiring ------------------------------------------------
    rendezvous = ObjectStoreAllReduce(
        uri=uri,
        world_size=world_size,
        rank=rank,
        config=AllReduceConfig(timeout_s=a.timeout),
        storage_options=json.loads(os.environ.get("COMPOSER_STORAGE_OPTIONS", "{}")),
    )
    manager = MockManager(allreduce=rendezvous)
    outer = make_diloco_outer_loop(
        inner_optimizer=trainer.optimizer,
        manager=manager,
        sync_every_h=a.sync_every_h,
    )
    trainer.add_callback(outer.callback())
    trainer.train()
    # -----------------------------------------------------------------------------------------

    rounds = [(h["round"], h["included_ranks"]) for h in outer.history if h["committed"]]
    print(f"replica {rank}: finished at outer round {outer.round}; rounds (round, ranks): {rounds}")


if __name__ == "__main__":
    main()
