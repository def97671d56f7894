"""PyTorch Distributed Checkpoint files, shared by the ``torch_dist`` (Megatron-Core) and
``dcp`` formats: ``.metadata`` read safely, ``.distcp`` items read and assembled, and DCP
saves written by us (torch-free) or streamed through DCP's own writer."""
