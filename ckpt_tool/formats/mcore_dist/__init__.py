"""Megatron-Core distributed checkpoints: ``torch_dist`` and the older ``zarr`` backend.

On disk (docs/formats.md §1-2, §12 per version): ``metadata.json`` (``{"sharded_backend": ...,
...}``, written last: the completeness marker), the common state (``common.pt``, ``torch.save``
of it; from Megatron-Core 0.19 the ``common_state`` object of the sharded data instead), and
either the PyTorch DCP files of ``torch_dist`` (``.metadata`` + ``__{rank}_{i}.distcp``, with
Megatron-Core's ``mcore_data`` in the metadata) or one zarr v2 array directory per tensor.

Modules: :mod:`.reader` (both backends), :mod:`.zarr_reader`, :mod:`.torch_dist_writer`,
:mod:`.zarr_writer`, :mod:`.zarr_store` (zarr arrays as Megatron-Core creates them),
:mod:`.config` (the ``metadata.json`` marker), :mod:`.forms` (what each version writes around
the sharded data). The real library's code: megatron-core
``dist_checkpointing/{core,serialization}.py`` and ``strategies/{torch,zarr,common}.py``.
"""
