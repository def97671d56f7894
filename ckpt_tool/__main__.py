"""``python -m ckpt_tool`` (and so ``torchrun -m ckpt_tool``) runs the ``ckpt`` command."""

from ckpt_tool.cli.app import main

if __name__ == "__main__":
    main()
