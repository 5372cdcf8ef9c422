"""Object-store schemes: what the store client does differently for each URI scheme.

`store.ObjectStore` speaks to every backend through fsspec; the few things that differ by
scheme are facts of a `Scheme` entry in ``SCHEMES``, which the client reads instead of comparing
scheme names (docs/object-store.md, "The store client"):

- ``file``: a folder of this machine (``local``): put-if-absent by hard link, overwrite by
  rename, reads into a private buffer;
- ``s3``, ``s3a`` (s3fs): a conditional PUT, written as one PUT (``s3_requests``: the single-PUT
  chunk size, ranged GETs of large objects, bulk DELETE), listing cache off;
- ``gs``, ``gcs`` (gcsfs): a conditional create (``ifGenerationMatch=0``), listing cache off, a
  custom ``endpoint_url`` served by the plain client (``gcs_endpoint_client``);
- ``memory`` (tests): one process's (``single_process``): put-if-absent is check-then-write under
  a process-wide lock; never a run's store.

A scheme not listed gets `GENERIC`: fsspec's ``pipe_file(mode="create")`` as put-if-absent (the
backend must refuse a create on an existing key), not accepted as a run's ``store.uri``.
Adding a scheme: its fsspec backend (a package that registers the protocol with fsspec), one
`Scheme` entry in ``SCHEMES`` below (``run_store=True`` once its put-if-absent is atomic across
machines), its tests and its line in docs/object-store.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["GENERIC", "SCHEMES", "Scheme", "run_store_schemes", "scheme"]


@dataclass(frozen=True)
class Scheme:
    """What the store client needs to know of one URI scheme (see the module docstring)."""

    local: bool = False  # a folder of this machine (file://)
    single_process: bool = False  # one process's store: check-then-write under a lock
    s3_requests: bool = False  # s3fs: single-PUT chunk size, ranged GETs, bulk DELETE
    gcs_endpoint_client: bool = False  # gcsfs: a custom endpoint_url gets the plain client
    run_store: bool = False  # replicas in other processes or machines can meet in it
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """Storage options set unless the user sets them."""


_NO_LISTING_CACHE = MappingProxyType({"use_listings_cache": False})
# A cached listing makes s3fs/gcsfs answer "not found" for objects created after it was taken,
# without asking the server; the protocol polls, so never cache.
_S3 = Scheme(s3_requests=True, run_store=True, options=_NO_LISTING_CACHE)
_GCS = Scheme(gcs_endpoint_client=True, run_store=True, options=_NO_LISTING_CACHE)

SCHEMES: dict[str, Scheme] = {
    "file": Scheme(local=True, run_store=True),
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "memory": Scheme(single_process=True),
}
GENERIC = Scheme()


def scheme(name: str) -> Scheme:
    """The entry of scheme ``name`` (case-insensitive), `GENERIC` for one not listed."""
    return SCHEMES.get(name.lower(), GENERIC)


def run_store_schemes() -> tuple[str, ...]:
    """The schemes a run's ``store.uri`` may use."""
    return tuple(name for name, s in SCHEMES.items() if s.run_store)
