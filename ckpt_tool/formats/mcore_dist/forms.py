"""What Megatron-Core versions write around a torch_dist checkpoint's sharded data
(docs/formats.md §12): where the common state lives and what ``metadata.json`` says.

* 0.12 to 0.18 (the *file* form): the common state is ``common.pt`` (``torch.save`` of a dict,
  written by rank 0 first); ``metadata.json`` is ``{"sharded_backend", "sharded_backend_version",
  "common_backend": "torch", "common_backend_version": 1}``, written last. 0.18 adds the opt-in
  ``integrity.json`` (sha256 of every file but itself, ``metadata.json`` included).
* 0.19 (the *object* form): no ``common.pt``; the common state is the ShardedObject
  ``common_state`` (global shape ``(1,)``, offset ``(0,)``, rank 0 the main replica), i.e. the
  DCP bytes item ``common_state/shard_0_1`` holding ``torch.save([state])``; ``metadata.json``
  is ``{"sharded_backend", "sharded_backend_version"}``. 0.19's ``load_common_state_dict`` still
  reads a ``common.pt`` first when there is one: a directory holding both has two common states,
  and the file wins.

A source's form is decided from its reader's metadata extras (``common_file``,
``common_object``); writers keep it (``form_of``). Every version reads the file form, only 0.19
and later the object form, so sources that are not Megatron-Core checkpoints get the file form.
Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["COMMON_FILE", "COMMON_STATE_KEY", "COMMON_STATE_ITEM", "DistForm", "FILE_FORM",
           "OBJECT_FORM", "form_of", "where_common"]

COMMON_FILE = "common.pt"
COMMON_STATE_KEY = "common_state"
#: the unique key of the ``common_state`` ShardedObject (offset ``0``, global shape ``1``)
COMMON_STATE_ITEM = f"{COMMON_STATE_KEY}/shard_0_1"


@dataclass(frozen=True)
class DistForm:
    """One of the two forms (see the module docstring). ``common_object``: the common state is
    the ``common_state`` object (0.19) rather than ``common.pt``."""

    common_object: bool = False

    @property
    def versions(self) -> str:
        """The Megatron-Core versions that write this form."""
        return "0.19" if self.common_object else "0.12-0.18"

    @property
    def common_where(self) -> str:
        return f"the {COMMON_STATE_KEY} object" if self.common_object else COMMON_FILE

    @property
    def config_has_common_backend(self) -> bool:
        """Whether ``metadata.json`` carries ``common_backend``/``common_backend_version``."""
        return not self.common_object

    def describe(self) -> str:
        return f"{self.common_where} (the Megatron-Core {self.versions} form)"


FILE_FORM = DistForm(common_object=False)
OBJECT_FORM = DistForm(common_object=True)


def form_of(extras: Mapping[str, Any] | None) -> DistForm:
    """The form of a checkpoint from its reader's metadata extras: the object form when the
    common state is the ``common_state`` object and there is no ``common.pt`` (which would win
    over it); the file form for everything else, sources of other formats included."""
    extras = extras or {}
    if extras.get("common_object") and not extras.get("common_file"):
        return OBJECT_FORM
    return FILE_FORM


def where_common(extras: Mapping[str, Any]) -> str | None:
    """Where a checkpoint with these extras keeps its common state, in words (None when it has
    none): its form, and a ``common_state`` object that a ``common.pt`` outranks."""
    if not extras.get("common_file") and not extras.get("common_object"):
        return None
    where = form_of(extras).describe()
    if extras.get("common_file") and extras.get("common_object"):
        where += (f"; also a {COMMON_STATE_KEY} object, which Megatron-Core 0.19 ignores "
                  "(validate compares the two)")
    return where
