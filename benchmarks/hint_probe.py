"""Can the demo's model read channel 2's hint? A supervised probe of the hinted examples.

    python benchmarks/hint_probe.py [--source none|train|beyond|both] [--feedback-with-solution]
                                    [--share 0.25] [--steps 1500] [--seed 0]

The embedded default's tiny model and task (`composer-replication train`'s), trained for
`--steps` steps of next-token loss (AdamW, lr 3e-3, 32 examples a step) on the oracle's answers to
the training prompts plus the hinted examples `Task.hinted_examples(share, source=...)` writes
(`--source none`: no hinted examples), then probed greedily:

* ``heldout_plain``: the held-out prompts, as the run evaluates them;
* ``train_plain`` / ``train_hinted``: 256 distinct training prompts NEVER hinted in training
  (the last ones of the split), plain and with the correct solution shown as channel 2 shows it
  for a failed rollout whose sibling succeeded (the template's `feedback_with_solution` decides
  whether the feedback on a near miss follows);
* ``rescued``: of those the model gets wrong plain, the share it gets right with the hint: what
  a hinted teacher adds over its student, the quantity channel 2's gate needs above 0;
  ``broken``: of those right plain, the share the hint makes wrong;
* ``beyond_hinted``: hinted problems beyond reach (when the source has them).

Last line: one JSON object with these and the settings. It isolates what the hinted examples
teach from RL's noise (docs/benchmarks-notebook.md, "A hint teacher better than its student");
~40-200 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCES = ("none", "train", "beyond", "both")


def main() -> None:
    import torch

    from composer_replication.assembly.build import build_model, build_task
    from composer_replication.config import load_config
    from composer_replication.data.hints import HintTemplate
    from composer_replication.tasks.task import Example, chat_prompt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=SOURCES, default="both")
    ap.add_argument("--feedback-with-solution", action="store_true")
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", type=int, default=256, help="training prompts probed")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    config = load_config(overrides=[f"run.seed={a.seed}"])
    model, tok = build_model(config)
    task = build_task(config)
    template = HintTemplate(feedback_with_solution=a.feedback_with_solution)
    train = task.train_examples()
    rows = [(ex.prompt, ex.answer) for ex in train]
    if a.source != "none":
        hinted = task.hinted_examples(a.share, template=template, source=a.source)
        rows += [(h.prompt, h.answer) for h in hinted]
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def encode(prompt: str) -> list[int]:
        out = tok.apply_chat_template(chat_prompt(prompt), add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    data = [(encode(p), tok(x, add_special_tokens=False)["input_ids"] + [end]) for p, x in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(a.seed)
    t0 = time.time()
    model.train()
    for _ in range(a.steps):
        batch = [data[rng.randrange(len(data))] for _ in range(32)]
        width = max(len(i) + len(x) for i, x in batch)
        ids = torch.full((32, width), tok.pad_token_id)
        labels = torch.full((32, width), -100)
        mask = torch.zeros((32, width), dtype=torch.long)
        for k, (i, x) in enumerate(batch):
            ids[k, : len(i) + len(x)] = torch.tensor(i + x)
            mask[k, : len(i) + len(x)] = 1
            labels[k, len(i) : len(i) + len(x)] = torch.tensor(x)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    train_s = time.time() - t0
    model.eval()

    @torch.no_grad()
    def right(pairs: list[tuple[str, Example]]) -> list[bool]:
        """Greedy completions judged by the task's verifier, as the run's evaluation judges."""
        out: list[bool] = []
        for start in range(0, len(pairs), 64):
            chunk = pairs[start : start + 64]
            enc = [encode(p) for p, _ in chunk]
            width = max(map(len, enc))
            ids = torch.full((len(enc), width), tok.pad_token_id)
            mask = torch.zeros_like(ids)
            for k, e in enumerate(enc):
                ids[k, width - len(e) :] = torch.tensor(e)
                mask[k, width - len(e) :] = 1
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=config.train.max_completion_length,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=[end],
            )
            for (_, example), row in zip(chunk, gen[:, width:].tolist(), strict=True):
                text = tok.decode(row, skip_special_tokens=False)
                out.append(task.verify(example, text).correct)
        return out

    def share(flags: list[bool]) -> float | None:
        return round(sum(flags) / len(flags), 4) if flags else None

    distinct = list({ex.prompt: ex for ex in train}.values())
    hinted_in_training = {p for p, _ in rows[len(train) :]}
    probed = [ex for ex in distinct if ex.prompt not in hinted_in_training][-a.probe :]
    plain = right([(ex.prompt, ex) for ex in probed])
    shown = right(
        [
            (
                template.render_text(
                    ex.prompt, ex.answer, task.verify(ex, task.failed_attempt(ex, 0)).feedback
                ),
                ex,
            )
            for ex in probed
        ]
    )
    result = {
        "source": a.source,
        "feedback_with_solution": a.feedback_with_solution,
        "share": a.share,
        "steps": a.steps,
        "seed": a.seed,
        "train_s": round(train_s, 1),
        "heldout_plain": share(right([(ex.prompt, ex) for ex in task.eval_examples()])),
        "train_plain": share(plain),
        "train_hinted": share(shown),
        "rescued": share([h for p, h in zip(plain, shown, strict=True) if not p]),
        "broken": share([not h for p, h in zip(plain, shown, strict=True) if p]),
        "probed": len(probed),
    }
    if a.source in ("beyond", "both"):
        beyond = task.hinted_examples(a.share, template=template, source="beyond")[: a.probe]
        result["beyond_hinted"] = share(right([(h.prompt, h) for h in beyond]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
