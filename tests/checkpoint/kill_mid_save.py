"""Starts an asynchronous save and dies before it commits; run by test_checkpoint.py as

    python -m tests.checkpoint.kill_mid_save DIR

Through `zaya_jax.checkpoint.open_manager` (the options `Checkpointer` uses) with
max_to_keep=1: saves step 1 and waits for it, starts saving step 2 (64 MiB, a second or more to
write), prints the directory listing as JSON and leaves with `os._exit` (no cleanup, no
waiting), like a process killed mid-save.
"""

import json
import os
import sys

import numpy as np
import orbax.checkpoint as ocp

from zaya_jax.checkpoint import open_manager


def main(directory: str) -> None:
  manager = open_manager(directory, read_only=False, max_to_keep=1, async_save=True)
  manager.save(1, args=ocp.args.Composite(model=ocp.args.StandardSave({"w": np.ones(4, np.float32)})))
  manager.wait_until_finished()
  big = np.random.default_rng(0).random(16 * 2**20, dtype=np.float32)  # 64 MiB, incompressible
  manager.save(2, args=ocp.args.Composite(model=ocp.args.StandardSave({"w": big})))
  print(json.dumps(sorted(os.listdir(directory))), flush=True)
  os._exit(0)


if __name__ == "__main__":
  main(sys.argv[1])
