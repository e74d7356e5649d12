"""An elastic coordinator process, run by tests/test_elastic_processes.py.

    python tests/elastic_coordinator.py PORT STEPS TOTAL LOG [--die-at S] [--resume]

Serves STEPS steps of TOTAL samples to 3 workers on 127.0.0.1:PORT,
appending each averaged step's shards to LOG (a JSON line each). With
--die-at it SIGKILLs itself once step S's shards are out (the workers
compute a step that will never be averaged); with --resume it picks the
run up where its workers are.
"""
import argparse
import json
import os
import signal
import sys

from ddpwire import Coordinator
from ddpwire.cli.serve import serve
from elastic_script import SILENCE


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("total", type=int)
    p.add_argument("log")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    coord = Coordinator(("127.0.0.1", args.port), 3, elastic=True, resume=args.resume,
                        samples_per_step=args.total, timeout=30.0, heartbeat=0.2,
                        heartbeat_timeout=SILENCE, join_timeout=60)
    coord.wait_for_workers()
    send = coord.send_shard_assignments

    def send_then_maybe_die(step):
        send(step)
        if step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
    coord.send_shard_assignments = send_then_maybe_die

    with open(args.log, "a") as log:
        def on_step(report):
            step, shards = coord.shard_log[-1]
            log.write(json.dumps({"step": step, "first": coord.first_step,
                                  "shards": {str(w): list(b) for w, b in shards.items()}}) + "\n")
            log.flush()
        serve(coord, steps=args.steps, total_samples=args.total, on_step=on_step)
    coord.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
