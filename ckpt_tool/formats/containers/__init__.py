"""The codecs several formats share, by what they decode: ``dcp/`` (DCP ``.metadata``,
``.distcp`` items, the torch-free DCP writer), ``torch_zip/`` (``torch.save`` zip archives,
read in place and written byte for byte), ``pickle/`` (the allowlisting unpickler, torch
stand-ins, pickling references to classes we do not import).

A format package (``formats/<name>/``) imports these, never another format package; nothing
here imports a format package (``tests/test_structure.py``).
"""
