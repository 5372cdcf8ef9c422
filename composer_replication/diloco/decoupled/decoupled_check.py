"""Decoupled DiLoCo's checks over a run's store: the end-of-run check and the chaos checker.

- `final_merges_problem`: before a decoupled run reports success, ``final.json`` is there and
  every fragment's final version has its merge record and no merge beyond it (None when
  nothing is wrong);
- `check_decoupled_run`: after a chaos run: the run finished; no committed merge was lost
  (every version a learner loaded is the stored one, the version chain has no gaps) or applied
  twice (no push in two merge records); every push written was consumed by a merge record or
  refused (a refusal record); killed learners started again, from the newest global; every
  live learner holds the same final global fragments (tests/run/test_chaos_checker.py plants
  each violation and shows it caught).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from composer_replication.exchange.protocol import tensors_digest
from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.store import ObjectStore
from composer_replication.json_types import JSONDict, as_int, as_list

__all__ = ["LearnerReport", "check_decoupled_run", "final_merges_problem"]


def final_merges_problem(store: ObjectStore, n_fragments: int) -> str | None:
    """Why the store does not hold a decoupled run's final merges (see the module
    docstring), or None."""
    docs = DecoupledStore(store)
    final = docs.read_final(n_fragments)
    if final is None:
        return "end-of-run check: the store has no final.json (the final merges are missing)"
    for p, v in enumerate(final["versions"]):
        merges = docs.versions(p, "merge")
        if v > 0 and v not in merges:
            return (
                f"end-of-run check: fragment {p}'s final version {v} (final.json) has no merge "
                "record"
            )
        if merges and max(merges) > v:
            return (
                f"end-of-run check: fragment {p} has a merge record {max(merges)} after its "
                f"final version {v} (final.json)"
            )
    return None


class LearnerReport(TypedDict, total=False):
    """What a live learner reports at the end of a chaos run (see `check_decoupled_run`)."""

    final_versions: list[int]  # the global version of each fragment it ends on
    digest: str  # of the weights it ends with
    starts: list[list[int]]  # the fragments' versions it started from at each (re)start
    loaded: dict[str, str]  # "<fragment>/<version>" -> digest of the globals it loaded
    written: list[str]  # the names of the pushes it wrote


def check_decoupled_run(
    store: ObjectStore,
    reports: dict[int, LearnerReport] | None = None,
    kills: Sequence[JSONDict] = (),
) -> JSONDict:
    """The after-run assertions over the store (and the learners' reports, if any).

    ``reports[rank]``: ``{"final_versions": [...], "digest": str, "starts": [[versions], ...],
    "loaded": {"<fragment>/<version>": digest}, "written": [push names]}`` (what each live
    learner held at the end, the versions it started from at each (re)start, the digests of
    the globals it loaded, the pushes it wrote). ``kills``: the injector's kill entries (with
    ``heads`` at the kill), in order.

    Invariants (each a problem when broken):

    * no merge is lost: each fragment's merge records run 1, 2, ... up to its final version,
      and the final version's state reads back;
    * every push written (in the store now, or in a report's ``written``) was consumed by a
      merge record (merged, rejected by screening, superseded or dropped) or refused (a
      refusal record): none was silently ignored;
    * no push is merged by two records;
    * a learner applied exactly the stored weights of every version it loaded;
    * a killed learner came back (a later start in its report) from at least the versions
      announced when it was killed;
    * every learner ends on the same final versions and weights.

    Returns {"ok": bool, "problems": [...], "finished", "versions", "merges",
    "rounds_lost", "pushes_unaccounted", "applied_twice", "rejoined", "same_final",
    "damaged_snapshots"} (stored snapshots of superseded versions that no longer read back:
    reported, not a failure).
    """
    docs = DecoupledStore(store)
    manifest = docs.read_manifest()
    if manifest is None:
        return {"ok": False, "problems": ["no decoupled manifest: the run never started"]}
    n_frag = len(manifest["fragments"])
    final = docs.read_final(n_frag)
    chain = _Chain(docs)
    if final is None:
        chain.problems.append("no final.json: the run did not finish")
    versions = final["versions"] if final else docs.read_heads(n_frag) or [0] * n_frag
    for p in range(n_frag):
        chain.check_fragment(p, versions[p])
    reports = reports or {}
    unaccounted = _unaccounted_pushes(docs, reports, chain.consumed)
    lost_pushes = [
        f"push {name} was written but never consumed by a merge or refused" for name in unaccounted
    ]
    chain.lost += _misapplied(reports, chain.stored_digest)
    rejoined = _late_rejoins(kills, reports, chain.unreadable)
    different = _different_finals(reports, versions)
    same = not different
    problems = chain.problems + different
    problems += chain.lost + lost_pushes + [f"applied twice: {t}" for t in chain.twice]
    problems += rejoined
    problems += [f"consumed twice (not merged twice): {t}" for t in chain.reconsumed]
    return {
        "ok": not problems,
        "problems": problems,
        "finished": final is not None,
        "versions": list(versions),
        "merges": chain.merges,
        "rounds_lost": len(chain.lost),
        "pushes_unaccounted": len(unaccounted),
        "applied_twice": len(chain.twice),
        "rejoined": not rejoined,
        "same_final": same,
        "damaged_snapshots": chain.damaged,
    }


def _misapplied(reports: dict[int, LearnerReport], stored_digest: dict[str, str]) -> list[str]:
    """A learner that applied other weights than the stored chain's for a version it loaded."""
    return [
        f"learner {rank} applied fragment/version {key} with different weights than the stored chain"
        for rank, rep in sorted(reports.items())
        for key, digest in (rep.get("loaded") or {}).items()
        if key in stored_digest and stored_digest[key] != digest
    ]


def _different_finals(reports: dict[int, LearnerReport], versions: Sequence[int]) -> list[str]:
    """One problem when the live learners do not all end on the final versions and weights."""
    finals = {
        r: tuple(rep.get("final_versions") or [])
        for r, rep in reports.items()
        if rep.get("final_versions") is not None
    }
    digests = {r: rep.get("digest") for r, rep in reports.items() if rep.get("digest")}
    same = (
        len(set(finals.values())) <= 1
        and len(set(digests.values())) <= 1
        and all(list(f) == list(versions) for f in finals.values())
    )
    return [] if same else [f"learners end on different globals: {finals} {digests}"]


def _unaccounted_pushes(
    docs: DecoupledStore, reports: dict[int, LearnerReport], consumed: dict[str, int]
) -> list[str]:
    """The pushes written (in the store now, or in a report's ``written``) that no merge record
    consumed and no refusal record names."""
    written = {pid.name for pid in docs.list_pushes()}
    for rep in reports.values():
        written |= set(rep.get("written") or [])
    return sorted(written - set(consumed) - set(docs.read_refusals()))


class _Chain:
    """What the stored merge records and global snapshots of a decoupled run say, fragment by
    fragment (`check_fragment`): lost or doubly applied merges, damaged snapshots."""

    def __init__(self, docs: DecoupledStore) -> None:
        self.docs = docs
        self.problems: list[str] = []
        self.lost: list[str] = []
        self.consumed: dict[str, int] = {}
        self.twice: list[str] = []  # merged (included) by two records: a merge applied twice
        self.reconsumed: list[str] = []  # consumed again without being merged again
        self.merged: set[str] = set()
        self.merges = 0
        self.stored_digest: dict[str, str] = {}
        self.damaged: list[str] = []
        self.unreadable: set[tuple[int, int]] = set()

    def check_fragment(self, p: int, final_version: int) -> None:
        records = self.docs.versions(p, "merge")
        self.merges += len(records)
        # every version 1..final is in the final model, each made by its record (kept for good)
        missing = sorted(set(range(1, final_version + 1)) - set(records))
        if missing:
            self.lost.append(
                f"fragment {p}: merge records {missing} missing; versions 1-"
                f"{final_version} make the final model"
            )
        beyond = [v for v in records if v > final_version]
        if beyond:
            self.lost.append(
                f"fragment {p}: merge records {beyond} beyond the final version {final_version}"
            )
        for v in records:
            self._record(p, v)
        self._snapshots(p)
        # A superseded version's snapshot may be damaged (its merge lives on in every later
        # version); the final one must be readable, or learners could not hold it.
        readable = f"{p}/{final_version}" in self.stored_digest
        if records and not readable and final_version in records:
            self.lost.append(
                f"fragment {p}: the final version {final_version} has no readable state"
            )

    def _record(self, p: int, v: int) -> None:
        try:
            rec = self.docs.read_merge(p, v)
        except Exception as exc:  # noqa: BLE001 - reported as a problem
            self.problems.append(f"fragment {p} record {v} unreadable: {exc}")
            return
        if rec is None:
            return
        merged_here = {
            e["push"]
            for e in rec["inputs"]
            if (rec["decisions"].get(e["push"]) or {}).get("included")
        }
        for name in rec["consumed"]:
            if name in self.consumed:
                both = name in merged_here and name in self.merged
                (self.twice if both else self.reconsumed).append(
                    f"{name} in records {self.consumed[name]} and {v} of fragment {p}"
                )
            self.consumed[name] = v
        self.merged |= merged_here

    def _snapshots(self, p: int) -> None:
        for v in self.docs.versions(p, "global"):
            try:
                tensors = self.docs.fetch_global(p, v, None)
            except Exception as exc:  # noqa: BLE001 - a snapshot damaged after it was written
                self.damaged.append(f"fragment {p} version {v}: {exc}")
                self.unreadable.add((p, v))
                continue
            if tensors is not None:
                self.stored_digest[f"{p}/{v}"] = tensors_digest(tensors)


def _late_rejoins(
    kills: Sequence[JSONDict],
    reports: dict[int, LearnerReport],
    unreadable: set[tuple[int, int]],
) -> list[str]:
    """Killed learners that restarted from globals older than those announced at the kill."""

    def newest_enough(start: list[int], heads: list[int]) -> bool:
        # every fragment at least at the version announced when the learner was killed, or
        # only damaged snapshots (unreadable, so correctly skipped) in between
        return all(
            a >= b or all((p, v) in unreadable for v in range(a + 1, b + 1))
            for p, (a, b) in enumerate(zip(start, heads))
        )

    rejoined: list[str] = []
    for kill in kills:
        rank = as_int(kill.get("target", -1))
        heads = [as_int(h) for h in as_list(kill.get("heads"))]
        starts = (reports.get(rank) or {}).get("starts") or []
        later = starts[1:]  # the starts after the first are restarts
        if (
            rank in reports
            and str(kill.get("outcome", "killed")).startswith("killed")
            and not later
        ):
            rejoined.append(f"learner {rank} was killed and never started again")
        elif heads and later and not any(newest_enough(s, heads) for s in later):
            rejoined.append(f"learner {rank} restarted from {later} older than {heads}")
    return rejoined
