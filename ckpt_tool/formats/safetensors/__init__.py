"""safetensors files, single or sharded with ``model.safetensors.index.json``.

On disk (docs/formats.md §6): an 8-byte little-endian header length, a JSON header
(``dtype``, ``shape``, ``data_offsets`` per tensor, ``__metadata__``), then the raw data.

Modules: :mod:`.reader`, :mod:`.writer`. The real library's code: huggingface/safetensors
(``safetensors/src/tensor.rs``) and transformers' sharded checkpoints.
"""
