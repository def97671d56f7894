"""``torch.save`` zip archives, shared by every format that stores them (DCP items,
Megatron-LM rank files, ``torch.save`` files, ``common.pt``): their zip structure and CRC-32s
checked as PyTorch reads them, tensors viewed in place, archives written byte for byte."""
