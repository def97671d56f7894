"""Peer harness, for the processes Megatron-Core spawns (not forks) during a peer run.

``run_peer.py`` puts this directory on ``PYTHONPATH``, so Python imports this module at the
start of every process of the run. In a ``multiprocessing`` spawn child (e.g. Megatron-Core's
persistent async checkpoint worker, which calls ``torch.cuda.set_device`` first) it installs
the same ``torch.cuda`` stand-ins as the ranks have; everywhere else it does nothing.
"""

import os
import sys

if os.environ.get("CKPT_PEER_IMPL") and "--multiprocessing-fork" in sys.argv:
    from cuda_on_cpu import patch_cuda_calls

    patch_cuda_calls()
