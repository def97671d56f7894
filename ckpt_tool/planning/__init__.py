"""Pure planning for ``ckpt reshard``: layout rules as data, rank-local pieces, feasibility and
per-rank read plans. Works on :mod:`ckpt_tool.model` metadata only; no torch, no tensor I/O.

Modules: ``sizes`` (model sizes, target layout, vocab padding, layer placement), ``layout``
(which axis each key splits along and how), ``pieces`` (the rank-local tensor of a key as
rectangles of the global tensor), ``source_layout`` and ``source_model`` (what a checkpoint
says of its layout, its model's sizes and its optimizer state), ``feasibility`` (every reason
a target cannot work), ``overlap`` (requested rectangles x stored chunks -> byte ranges),
``reshard`` (the plan).
"""
