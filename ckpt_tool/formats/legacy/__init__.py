"""Megatron-LM legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` file per rank.

On disk (docs/formats.md §4): ``<save>/latest_checkpointed_iteration.txt`` and
``iter_NNNNNNN/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` (``model`` or
``model0``.. per virtual stage, ``optimizer``, ``args``, ``rng_state`` ...), plus
``distrib_optim.pt`` beside it for the distributed optimizer.

Modules: :mod:`.reader`, :mod:`.metadata` (the reader's scan of the rank files),
:mod:`.layout` (rank directories, names and split rules), :mod:`.pieces` (per-rank pieces
merged into global tensors), :mod:`.optim` (optimizer state), :mod:`.writer`. The real library's code: Megatron-LM ``megatron/training/checkpointing.py``
and megatron-core ``optimizer/distrib_optimizer.py``.
"""
