"""Hugging Face transformers model directories: ``config.json`` + the weights.

Weights are ``model.safetensors``, sharded ``*.safetensors`` with
``model.safetensors.index.json``, or ``pytorch_model.bin`` / sharded ``pytorch_model-*.bin``
with ``pytorch_model.bin.index.json`` (read through the allowlisting unpickler). See
docs/formats.md section 10.

Modules: :mod:`.reader`, :mod:`.writer`. Converting to and from Megatron-Core checkpoints is
planned by ``ckpt_tool.planning.hf_rules`` / ``hf_plan`` and run by ``ckpt_tool.ops.convert._hf``.
"""
