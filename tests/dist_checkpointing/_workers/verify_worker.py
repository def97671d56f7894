"""Every rank verifies a checkpoint with the byte scan split over the ranks; prints its verdict."""

import sys
from pathlib import Path

from ckpt_tool._torchrun import exit_cleanly
from ckpt_tool.errors import FindingsError
from ckpt_tool.ops._output_staging import verify_output
from ckpt_tool.parallel import ranks

r = ranks()
try:
    verify_output(Path(sys.argv[1]), trust=False, what="converted", ranks=r)
    print(f"rank {r.rank}: verified", flush=True)
except FindingsError as exc:
    print(f"rank {r.rank}: raised: {exc}", flush=True)
exit_cleanly(0)
