"""Writer of Hugging Face model directories.

The weights go through the registered safetensors writer (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` above
``max_shard_size``); then ``config.json`` (``WriterOptions.extra["hf_config"]``) and, when
given, ``generation_config.json`` (``extra["generation_config"]``). Only model weights: the
request's common state and objects are not written (a note says so). Under torchrun each rank
writes its share of the shards (the safetensors writer splits them) and rank 0 the index and
the JSON files.
"""

from __future__ import annotations

import json
from dataclasses import replace

from ckpt_tool.formats.writer import WriteRequest, Writer, dropped_objects_note, writer_for

__all__ = ["HfWriter"]


class HfWriter(Writer):
    """See the module docstring."""

    format_name = "hf"
    supports_ranks = True
    keeps_common = "none"
    shards_by_size = True

    def write(self, request: WriteRequest) -> list[str]:
        """The safetensors shards, then ``config.json`` (+ ``generation_config.json``)."""
        self.objects_written = 0  # the format holds tensors only
        notes = dropped_objects_note(request, "an HF model directory holds weights only")
        weights = replace(request, common={}, meta=replace(request.meta, objects=()))
        writer_for("safetensors")(self.directory, replace(self.options, file_name=None)
                                  ).write(weights)
        if request.ranks is not None and not request.ranks.is_main:
            return notes
        config = self.options.extra.get("hf_config") or {}
        (self.directory / "config.json").write_text(
            json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        gen = self.options.extra.get("generation_config")
        if gen:
            (self.directory / "generation_config.json").write_text(
                json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return notes
