"""How a session's deadlines nest: whoever waits on another's wait waits
longer, by design rather than by equal numbers.

In an elastic session a worker's wait on its coordinator spans the
coordinator's own waits on the other workers, so a survivor must never give
up while the coordinator, within its deadlines, is still settling what
another worker did:

- The coordinator waits up to its ``timeout`` for each worker's gradients.
  A worker waits for the answer to its own (the average, or StepAborted)
  for :func:`answer_wait` of its ``timeout``: that timeout and the share
  below, for the call-off that may come at the end of the coordinator's.
- Between two steps, everything the coordinator does before the next
  shards go out (reading out a called-off step, waiting for joiners,
  handing them the model's state) ends within :data:`BOUNDARY_SHARE` of
  its timeout from when the workers start waiting for their shard, which
  they do for their whole ``timeout``.

Both hold when every worker's timeout is at least the coordinator's
(docs/sessions.md, "Deadlines nest").

On the mesh the coordinator waits on a worker that may itself wait on a
peer: a worker's wait on its peers ends ``timeout`` after it read the
coordinator's last message, and then it names the peer; so when several
workers are silent at the coordinator's deadline, it listens
:func:`accusation_wait` longer for the one that names another (for workers
whose timeout is the coordinator's or shorter).
"""
from __future__ import annotations

__all__ = ["BOUNDARY_SHARE", "accusation_wait", "answer_wait"]

#: the share of the coordinator's timeout its work between two steps may take
BOUNDARY_SHARE = 0.5


def answer_wait(timeout: float) -> float:
    """How long an elastic session's worker waits for the answer to its
    gradients: the coordinator's wait for everyone's, then the call-off."""
    return timeout * (1.0 + BOUNDARY_SHARE)


def accusation_wait(timeout: float) -> float:
    """How long past its deadline a mesh step's collect keeps listening when
    more than one worker is silent and nothing yet says which stalled: a
    worker waiting on a peer read the coordinator's last message by the
    coordinator's deadline (else it is itself the late one), however long
    it computed or was busy between steps, so its report naming the peer
    comes within its own ``timeout`` past that deadline. The collect raises
    as soon as an answer singles a worker out; it waits all of this only
    when no silent worker says anything (every one is stalled)."""
    return timeout
