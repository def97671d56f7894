"""A single ``torch.save`` file (a zip: ``<archive>/data.pkl`` + ``<archive>/data/<n>``).

On disk (docs/formats.md §6): uncompressed zip records; tensors are read in place at their
storage's byte range. Shared with the legacy format: :mod:`ckpt_tool.formats.containers.torch_zip.torch_save_files`.

Modules: :mod:`.reader`, :mod:`.writer`. The real library's code: torch ``serialization.py``
and ``caffe2/serialize/inline_container.cc``.
"""
