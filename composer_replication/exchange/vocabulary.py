"""The exchange's vocabulary: its errors, the dtype names of its headers, `Contribution` and
`StepResult`.

A leaf of the package: every other module of exchange/ may import it, and it imports only the codec
registry (`codecs`, which imports nothing else of ours) and the checksum algorithms (`checksums`),
so that the modules speaking this vocabulary (protocol, wire, contribution_screening,
merge_arithmetic, signing, ...) never need each other for it and exchange/ has no import circle
(tests/test_architecture.py checks that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import torch

from composer_replication.exchange import checksums, codecs
from composer_replication.json_types import JSONDict

__all__ = [
    "DTYPES",
    "CommitRecord",
    "Contribution",
    "CorruptContributionError",
    "ExchangeCancelledError",
    "FrameError",
    "ListedContributionError",
    "ModelMismatchError",
    "QuorumLostError",
    "RoundStoppedError",
    "StepResult",
    "StoreTimeoutError",
    "UpdateRefusedError",
    "dtype_name",
]


class StoreTimeoutError(TimeoutError):
    """A wait on the object store exceeded one of the explicit timeouts (upload/step/run)."""


class CorruptContributionError(ValueError):
    """An object read from the store is malformed, truncated, forged or inconsistent."""


class FrameError(CorruptContributionError):
    """The bytes are not a well-formed safetensors payload (the message says why)."""


class ListedContributionError(CorruptContributionError):
    """``step`` is committed, but a contribution its commit record lists is gone or does not
    verify here (rotted or overwritten after other replicas read it). Nothing is averaged: the
    step's result is what the replicas that could apply the record hold (the committer always
    can), so a manager adopts their published state of ``step`` instead of retrying the step
    (`store_manager.ObjectStoreManager`). ``committed_by`` and ``included_ranks``: the record's."""

    def __init__(
        self, message: str, *, step: int, committed_by: int | None, included_ranks: list[int]
    ) -> None:
        super().__init__(message)
        self.step = step
        self.committed_by = committed_by
        self.included_ranks = list(included_ranks)


class RoundStoppedError(CorruptContributionError):
    """A round the run cannot get past: retrying it would meet the same objects, and training
    on without it would pass for success. ``rejected``: rank -> why its contribution was
    refused (may be empty)."""

    def __init__(self, message: str, *, step: int, rejected: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.rejected = dict(rejected or {})


class QuorumLostError(RoundStoppedError):
    """Every rank of ``step`` is judged (valid or refused) and fewer than ``min_replicas`` are
    valid: the step can never commit (contributions are immutable, so a retry would meet the
    same objects)."""


class UpdateRefusedError(RoundStoppedError):
    """``step`` committed, but its global update is not applied: unsigned runs screen it
    against the run's recent rounds (a tripwire for a forged commit record, docs/security.md)."""


class ModelMismatchError(ValueError):
    """The stored run manifest describes a different model/world size/codec than this replica."""


class ExchangeCancelledError(RuntimeError):
    """``cancel()`` was called while a wait was in progress."""


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
"""The tensor dtypes a contribution may carry, by the name its header gives them."""


def dtype_name(dtype: torch.dtype) -> str:
    """The header name of ``dtype`` (ValueError for a dtype a contribution cannot carry)."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported tensor dtype {dtype}; pseudo-gradients must be floating point")


@dataclass
class StepResult:
    """What one ``allreduce`` step did (``ObjectStoreAllReduce.last_result``)."""

    step: int
    included_ranks: list[int]
    excluded_ranks: list[int]
    weights: dict[int, float]
    bytes_uploaded: int
    bytes_downloaded: int
    seconds: float
    codec: str = "fp32"
    committed_by: int | None = None
    rejected: dict[int, str] = field(default_factory=dict)  # rank -> why its payload was refused
    aggregate: str = "mean"
    # requests this call sent to the store, by kind (put/get/head/list/delete)
    requests: dict[str, int] = field(default_factory=dict)
    # where ``seconds`` went: encoding and uploading this rank's contribution; waiting for the
    # peers (polling, fetching and checking their contributions, screening, the commit record);
    # merging what the commit record lists into the result
    upload_seconds: float = 0.0
    wait_seconds: float = 0.0
    merge_seconds: float = 0.0


class CommitRecord(TypedDict):
    """A validated commit record (`protocol.parse_commit`): what decides a step for everyone.

    Ranks are ints here (JSON object keys are strings in the stored record). The fields marked
    NotRequired are absent in records of older versions; readers apply their defaults
    (``aggregate`` "mean", ``trim`` 0, ``weighting`` "equal"). With signing on it also carries
    ``run_id``, ``signer`` and ``signature``.
    """

    format: int
    kind: str
    step: int
    included_ranks: list[int]
    weights: dict[int, float]  # rank -> its weight in the mean (sum 1)
    scales: dict[int, float]  # rank -> its norm_clip scale ({} or 1.0: unclipped)
    checksums: dict[int, dict[str, str]]  # rank -> {"algo", "value"} every reader pins
    writers: dict[int, str | None]  # rank -> the writer id of the included upload
    excluded: dict[int, str]  # rank -> why it is not in the step
    world_size: NotRequired[int]
    aggregate: NotRequired[str]
    trim: NotRequired[int]
    weighting: NotRequired[str]
    tokens: NotRequired[dict[str, int | None]]
    decisions: NotRequired[dict[str, JSONDict]]  # rank -> contribution_screening.Decision.to_json()
    committed_by: NotRequired[int]
    run_id: NotRequired[str]
    signer: NotRequired[str]
    signature: NotRequired[str]


@dataclass
class Contribution:
    """A validated contribution: header fields plus the encoded parts (not yet decoded)."""

    rank: int
    step: int
    tokens: int | None
    inner_steps: int | None
    codec: str
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    digest: str  # hex checksum of the data section, computed with ``checksum_algo``
    parts: dict[str, torch.Tensor]
    nbytes: int
    checksum_algo: str = field(default_factory=checksums.default_checksum)
    extra: dict[str, Any] = field(default_factory=dict)  # caller-defined header fields (JSON)
    # parts live in a private writable buffer (a fetched local object) that the aggregation
    # may overwrite instead of allocating; never True for a replica's own tensors
    private: bool = False
    writer: str | None = None  # random id of the upload that wrote it (header "writer")

    @property
    def checksum(self) -> dict[str, str]:
        """The self-describing checksum as stored in headers and commit records."""
        return {"algo": self.checksum_algo, "value": self.digest}

    def encoded(self) -> list[tuple[str, list[int], dict[str, torch.Tensor]]]:
        """(name, shape, {part suffix: tensor}) per tensor, in header order, not decoded."""
        by_index: list[dict[str, torch.Tensor]] = [{} for _ in self.names]
        for key, t in self.parts.items():  # keys are "t<i>.<part>"
            i, _, part = key[1:].partition(".")
            by_index[int(i)][part] = t
        return [(n, s, p) for n, s, p in zip(self.names, self.shapes, by_index)]

    def decode(self) -> dict[str, torch.Tensor]:
        """name -> float32 tensor of the original shape (pure function of the stored parts)."""
        codec = codecs.get(self.codec)
        return {
            name: codec.decode(parts, math.prod(shape)).view(shape)
            for name, shape, parts in self.encoded()
        }
