"""The ddpwire command: coordinator, worker and demo.

`ddpwire coordinator` needs no torch; `ddpwire worker` and the demo's
workers need the [torch] extra.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, List, Optional, Union

from .._text import counted
from .._version import __version__
from ..wire.auth import TOKEN_ENV, load_token
from ..session.balance import CHOICES
from ..session.coordinator import Coordinator
from ..wire.errors import DdpwireError, OptionError, PeerLost, WorkerLost, without_frame_progress
from ..wire.extensions import Extension, encode_u64
from ..plane.codecs import names as codec_names
from ..plane.incast import FLOOR
from ..session.launch import from_environment, parse_addr
from ..plane.mesh import DEFAULT_CONGESTION
from ..session.metrics import MetricsFile
from .plot import add_parser as add_plot_parser, run_plot
from ..session.progress import ProgressBar, ShownByTheBar, break_line, unit
from .serve import StepReport, serve
from .torch_check import require_torch

__all__ = ["main"]

log = logging.getLogger("ddpwire")

#: ``ddpwire worker``'s exit status when the coordinator ended the run
#: before its last step (it was interrupted or terminated): not an error
EXIT_STOPPED = 3


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a peer may stay silent before it counts as lost (default 120)")
    p.add_argument("--heartbeat", type=float, default=None, metavar="SECONDS",
                   help="send a heartbeat on an idle connection every SECONDS, so that a peer "
                        "frozen or cut off is named after three missed ones instead of after "
                        "--timeout (default: off; every side needs it, and every peer must be "
                        "a ddpwire one)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def _token(p: argparse.ArgumentParser) -> None:
    # a file or the environment, never the token itself: command lines are
    # visible to every user of the machine
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help=f"file holding the shared token: only workers that prove they know it "
                        f"join, and they check the coordinator knows it too (default: "
                        f"${TOKEN_ENV} if set, else no token)")
    p.add_argument("--encrypt", choices=("on", "off"), default="on",
                   help="with a token, seal every frame after the join (AES-256-GCM, keys from "
                        "an X25519 exchange bound to the token); 'off' sends them in the clear "
                        "(default: %(default)s)")


DEFAULT_STEPS = 60


def _training(p: argparse.ArgumentParser, steps_help: Optional[str] = None) -> None:
    # a worker's default is None, so that a --steps it was given can be told apart
    p.add_argument("--steps", type=_positive, default=None if steps_help else DEFAULT_STEPS,
                   help=steps_help or f"training steps (default {DEFAULT_STEPS})")
    p.add_argument("--samples", type=int, default=256,
                   help="samples per step, split between the workers (default 256)")
    p.add_argument("--per-block", action="store_true",
                   help="average block by block while backward runs (transformer model)")
    p.add_argument("--blocks", type=int, default=4,
                   help="transformer blocks (per-block mode; default 4)")
    p.add_argument("--sync-every", type=_positive, default=1, metavar="H",
                   help="local steps for slow links (DiLoCo): each worker takes H optimizer steps "
                        "on its own shards, then the change of the weights is averaged and "
                        "applied by an outer Nesterov step (default 1: every step averaged). "
                        "--steps and --samples keep their meaning (inner steps, samples per "
                        "inner step); give every side the same H")


def _worker_model(p: argparse.ArgumentParser, workers_here: str) -> None:
    p.add_argument("--model", choices=["mlp", "transformer"], default=None,
                   help="demo model: mlp on digits (default) or transformer (default with --per-block)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N, mps or cpu (default: CUDA, else MPS, else CPU; env DDPWIRE_DEVICE)")
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch threads per worker process (default: the usable cores divided by "
                        f"{workers_here}, unless OMP_NUM_THREADS is set; 0 leaves torch's own "
                        f"default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpwire", description="Data-parallel training over plain TCP: a coordinator and its workers.")
    parser.add_argument("--version", action="version", version=f"ddpwire {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run a standalone coordinator (no torch needed)",
                       epilog="Exit status: 0 when the run is done, 1 on an error, 2 for a bad "
                              "command line, 130 when interrupted (Ctrl-C, SIGINT), 143 when "
                              "terminated (SIGTERM). Interrupted or terminated, it first sends "
                              "its workers Shutdown (once the frame it is sending them ends).")
    c.add_argument("--bind", default="0.0.0.0:29400", help="HOST:PORT to listen on (default 0.0.0.0:29400)")
    c.add_argument("--workers", type=_positive, required=True, help="number of workers to wait for")
    c.add_argument("--join-timeout", type=float, default=600.0,
                   help="seconds to wait for every worker to join (default 600)")
    c.add_argument("--socket-threads", choices=["auto", "on", "off"], default="auto",
                   help="stream each step on a receiving and a sending thread per worker: on, off, "
                        "or auto (default: on for gradients of 1 MiB or more with a core per worker "
                        "plus one)")
    c.add_argument("--handshake-timeout", type=float, default=10.0,
                   help="seconds one connection has to complete its join handshake (default 10)")
    c.add_argument("--topology", choices=["auto", "star", "mesh"], default="auto",
                   help="flat steps: auto (default: the workers average among themselves when "
                        "every one can), star (always through this coordinator) or mesh")
    c.add_argument("--compression", choices=codec_names(), default=None,
                   help="send gradients between mesh workers as 16-bit words (bf16, fp16) or a byte an "
                        "element and a scale per 256 (int8) (default: float32)")
    c.add_argument("--coordinator-share", type=_share, default="auto", metavar="FRACTION",
                   help="part of each mesh step's vector this coordinator averages over its own "
                        "link, 0 to below 1 (default auto: 0.75/(N+1) from 3 workers on other "
                        "hosts; pass 0 when this machine's link is slower than the workers')")
    c.add_argument("--receive-window", type=_window, default="auto", metavar="BYTES",
                   help="bound on what each star worker may have in flight towards this "
                        "coordinator, e.g. 256K (default auto: sized from each worker's round "
                        "trip against incast; 'system' leaves it to the kernel)")
    c.add_argument("--elastic", action="store_true",
                   help="go on without a worker that is lost (killed, cut off, or silent past "
                        "--timeout): the step is computed again by the others, with all of its "
                        "samples (flat steps through this coordinator; every worker a ddpwire "
                        "worker)")
    c.add_argument("--resume", action="store_true",
                   help="with --elastic, pick up a run whose coordinator was lost: its workers "
                        "kept their state and join again (same --bind), and the run goes on "
                        "from the step they are at")
    c.add_argument("--min-workers", type=int, default=None, metavar="K",
                   help="with --elastic, end the run (as without it) once fewer than K workers "
                        "are left (default 1)")
    _token(c)
    c.add_argument("--require-encryption", action="store_true",
                   help="refuse a worker that cannot seal its link (needs a token and "
                        "--encrypt on)")
    _balance(c)
    _training(c)
    _common(c)

    w = sub.add_parser("worker", help="join a coordinator and train the demo model",
                       epilog="Exit status: 0 when the run is done, 1 on an error (the "
                              "coordinator lost included), 2 for a bad command line, 3 when the "
                              "coordinator stopped the run before its last step (interrupted or "
                              "terminated: the worker still writes its report).")
    w.add_argument("--connect", default=None,
                   help="coordinator HOST:PORT (default under torchrun: MASTER_ADDR, MASTER_PORT+1)")
    w.add_argument("--node-id", default=None, help="name reported to the coordinator")
    w.add_argument("--report", default=None, help="write the final report (JSON) to this file")
    w.add_argument("--save", default=None, metavar="FILE",
                   help="write the model's weights (torch state_dict) to FILE when training ends, "
                        "however it ends")
    w.add_argument("--step-lines", action="store_true",
                   help="print each step's loss, correct and total samples of this worker's shard "
                        "on stdout as it ends, one JSON line per step (the per-block demo shows "
                        "them, since block messages carry no loss)")
    w.add_argument("--no-mesh", action="store_true",
                   help="do not offer to average with the other workers directly (no listening port)")
    w.add_argument("--tcp-congestion", default=DEFAULT_CONGESTION, metavar="NAME",
                   help="TCP congestion control of the links to the other workers, where the "
                        "kernel lets a socket choose (default: %(default)s; 'system' keeps the "
                        "system's)")
    _token(w)
    _worker_model(w, "the workers of the session on this machine, counted once every worker "
                     "has joined")
    _training(w, steps_help=f"under torchrun, the training steps of the coordinator rank 0 hosts "
                            f"(default {DEFAULT_STEPS}); elsewhere refused: the coordinator's "
                            f"--steps sets how long the run is")
    _common(w)

    d = sub.add_parser("demo", help="coordinator and N local worker processes training a real model")
    d.add_argument("--workers", type=_positive, default=2, help="worker processes (default 2)")
    d.add_argument("--elastic", action="store_true",
                   help="go on when a worker process dies (killed, say): the others redo its "
                        "step and finish the run")
    _balance(d)
    _worker_model(d, "--workers")
    _training(d)
    _common(d)
    add_plot_parser(sub)
    return parser


def _balance(p: argparse.ArgumentParser) -> None:
    p.add_argument("--balance", choices=["auto", "on", "off"], default="auto",
                   help="size each step's shards by a fitted model of each worker's step "
                        "(fixed part plus per sample), so a faster machine computes more of "
                        "each step and nobody waits: auto (default: when every worker is a "
                        "ddpwire worker, with trials of equal and nudged shards now and then "
                        "that keep whatever measured steps show is faster), on (always, any session: a reference worker's speed "
                        "is seen from when its gradient arrives) or off (equal shards, T // n)")
    p.add_argument("--metrics", default=None, metavar="FILE",
                   help="write one JSON line per step to FILE: the loss, step and allreduce "
                        "times, and each worker's name, shard, compute, wait, fitted fixed and "
                        "per-sample time")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number from 1; got {text!r}")
    return value


def _share(text: str) -> Union[str, float]:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to below 1, or auto; got {text!r}")
    return value


def _window(text: str) -> Union[str, int, None]:
    if text in ("auto", "system"):
        return None if text == "system" else text
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or not FLOOR <= int(digits) * scale <= 1 << 30:
        raise argparse.ArgumentTypeError(
            f"bytes from {FLOOR} (64K) to 1G (K and M suffixes), auto or system; got {text!r}")
    return int(digits) * scale


class UsageError(ValueError):
    """A command line asking for what the command cannot do: one line on
    stderr and exit status 2, as for argparse's own errors."""


#: the flags of the options whose keyword is not the flag's name
#: (OptionError.spelled: the checks are the Python API's, the words the command's)
FLAGS = {"expect_workers": "--workers", "samples_per_step": "--samples", "token": "--token-file"}


def writable(path: Optional[str], flag: str) -> None:
    """Refuse, before anything listens or trains, a file the run could not
    write at its end (a report) or at its first step (the metrics)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: that is a folder, not a file")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable by this user")


def token_from(path: Optional[str]) -> Optional[bytes]:
    """``--token-file``'s token (or $DDPWIRE_TOKEN), a file that cannot be
    read being a bad command line."""
    try:
        return load_token(path)
    except ValueError as exc:
        raise UsageError(f"--token-file: {exc}") from None


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM in the coordinator command, raised in the main
    thread as Ctrl-C raises KeyboardInterrupt; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM while the coordinator command runs.

    Either raises :class:`Interrupted` in the main thread: at once while no
    frame towards a worker is open, else once the step ends, since the
    workers are then sent Shutdown (:meth:`Coordinator.stop_workers`),
    which may only go between two frames. A second signal while the first
    waits raises at once. Outside the main thread (a hosted coordinator)
    nothing is installed."""

    def __init__(self) -> None:
        self.coordinator: Optional[Coordinator] = None
        self.pending: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: object) -> None:
        coord = self.coordinator
        if self.pending is None and coord is not None and coord.mid_frame:
            self.pending = signum
            return
        raise Interrupted(signum)

    def at_step_end(self) -> None:
        """Raise the signal that came inside the step, if one did."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


def run_coordinator(args: argparse.Namespace, bind=None,
                    stops: Optional[StopSignals] = None) -> List:
    host, port = bind or parse_addr(args.bind)
    socket_threads = {"auto": None, "on": True, "off": False}[getattr(args, "socket_threads", "auto")]
    metrics_path = getattr(args, "metrics", None)
    with Coordinator((host, port), expect_workers=args.workers, timeout=args.timeout,
                     heartbeat=getattr(args, "heartbeat", None),
                     join_timeout=getattr(args, "join_timeout", 600.0),
                     handshake_timeout=getattr(args, "handshake_timeout", 10.0),
                     socket_threads=socket_threads, samples_per_step=args.samples,
                     token=token_from(getattr(args, "token_file", None)),
                     encrypt=getattr(args, "encrypt", "on") == "on",
                     require_encryption=getattr(args, "require_encryption", False),
                     topology=getattr(args, "topology", "auto"),
                     compression=getattr(args, "compression", None),
                     coordinator_share=getattr(args, "coordinator_share", "auto"),
                     receive_window=getattr(args, "receive_window", "auto"),
                     per_block=args.per_block,
                     balance=CHOICES[getattr(args, "balance", "auto")],
                     elastic=getattr(args, "elastic", False),
                     min_workers=getattr(args, "min_workers", None),
                     resume=getattr(args, "resume", False),
                     # ddpwire workers learn the run's length, and so tell
                     # a Shutdown before its end (stop_workers) from the end
                     extensions={Extension.STEPS: encode_u64(args.steps)}) as coord:
        h, p = coord.local_addr
        log.info("coordinator listening on %s:%d, waiting for %s", h, p,
                 counted(args.workers, "worker"))
        coord.wait_for_workers()
        if stops is not None:
            stops.coordinator = coord
        bar = ProgressBar(args.steps, label=unit(args.sync_every))
        metrics = MetricsFile(metrics_path) if metrics_path else None

        def on_step(report: StepReport) -> None:
            bar.update(report)
            if metrics is not None:
                metrics.write(report)
            if stops is not None:
                stops.at_step_end()  # a frame boundary: a signal may stop the run here
        try:
            serve(coord, steps=args.steps, total_samples=args.samples, per_block=args.per_block,
                  num_blocks=args.blocks, on_step=on_step)
        except KeyboardInterrupt:
            bar.close()
            told = coord.stop_workers()
            log.info("stopped the run after %d of %s: Shutdown sent to %d of %s", bar.done,
                     counted(args.steps, "step"), told, counted(len(coord.workers), "worker"))
            raise
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
        log.info("done: %s", bar.summary())
        return []


def run_worker(args: argparse.Namespace) -> int:
    launch = from_environment(args.connect)
    if launch.rank is None and args.steps is not None:
        # the coordinator decides how long the run is (the steps extension
        # tells the worker, never the other way): a value here would be ignored
        raise UsageError("--steps is for the coordinator: the coordinator's --steps sets how "
                         "long the run is, and a worker trains until the coordinator ends it "
                         "(under torchrun, rank 0 hosts the coordinator and takes --steps)")
    token = token_from(args.token_file)
    require_torch("ddpwire worker")
    from ..torch.job import train_worker  # torch only here

    hosted: Optional[threading.Thread] = None
    failure: List[BaseException] = []
    if launch.hosts_coordinator:
        # torchrun's rank 0 also runs the coordinator, on every interface
        coord_args = argparse.Namespace(**vars(args), workers=launch.world_size)
        if coord_args.steps is None:
            coord_args.steps = max(1, DEFAULT_STEPS // args.sync_every)  # rounds

        def host() -> None:
            try:
                run_coordinator(coord_args, bind=("", launch.addr[1]))
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)
        hosted = threading.Thread(target=host, name="ddpwire-coordinator", daemon=True)
        hosted.start()
    node_id = args.node_id
    if node_id is None and launch.rank is not None:
        import socket
        node_id = f"{socket.gethostname()}-rank{launch.rank}"
    join_turn = None
    if launch.rank is not None and launch.world_size is not None:
        # worker ids are the order of joining: join in rank order so id == rank
        from ..torch.rank_order import RankOrder
        join_turn = RankOrder.from_environment(launch.rank, launch.world_size, args.timeout)
    # without --threads the job counts the session's workers on this machine
    # once they have all joined (ddpwire.plane.threads.workers_here)
    report = train_worker(launch.addr, model=_model(args), per_block=args.per_block,
                          blocks=args.blocks, samples_per_step=args.samples, lr=args.lr,
                          sync_every=args.sync_every,
                          device=args.device, node_id=node_id, timeout=args.timeout,
                          heartbeat=args.heartbeat, save=args.save,
                          seed=args.seed, threads=args.threads, join_turn=join_turn,
                          token=token, encrypt=args.encrypt == "on",
                          mesh=not getattr(args, "no_mesh", False),
                          tcp_congestion=None if args.tcp_congestion == "system"
                          else args.tcp_congestion,
                          on_step=_print_step if args.step_lines else None)
    if hosted is not None:
        hosted.join(args.timeout)
        if failure:
            raise failure[0]
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_dict(), f)
    else:
        write_line(json.dumps(report.to_dict(per_step=False)))
    if report.stopped_early:
        length = (f"{report.reached} of {counted(report.run_steps, 'step')}" if report.run_steps
                  else counted(report.reached, "step"))
        print(f"ddpwire: the coordinator stopped the run after {length}", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def _print_step(result: Any) -> None:
    """A --step-lines line: the step and this worker's figures on its shard."""
    write_line(json.dumps({"step": result.step, "loss": result.loss, "correct": result.correct,
                           "total": result.total}))


def write_line(text: str) -> None:
    """One line on stdout in a single write(2): under torchrun every rank
    shares one pipe and runs `python -u`, where print() writes the text and
    then its newline: two ranks' lines could land on one. A pipe keeps a write
    of up to PIPE_BUF bytes (512 or more; 4096 on Linux) whole, and the
    report line stays well under that."""
    sys.stdout.flush()
    data = (text + "\n").encode()
    fd = sys.stdout.fileno()
    while data:
        data = data[os.write(fd, data):]


def _model(args: argparse.Namespace) -> str:
    return args.model or ("transformer" if args.per_block else "mlp")


def rounds(args: argparse.Namespace) -> None:
    """--sync-every H: the protocol's steps become rounds of H inner steps,
    with H times the samples (``args.inner_samples`` keeps the figure given)."""
    args.inner_samples = args.samples
    h = args.sync_every
    if h == 1:
        return
    if args.per_block:
        raise UsageError("--sync-every averages one change of the weights per round: it needs "
                         "flat steps, not --per-block")
    if args.steps is not None and args.steps % h:
        raise UsageError(f"--steps {args.steps} is not a whole number of rounds of "
                         f"--sync-every {h}")
    args.samples *= h
    if args.steps is not None:
        args.steps //= h


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``ddpwire`` console script and ``python -m ddpwire``."""
    args = build_parser().parse_args(argv)
    if args.command == "plot":  # reads a file: no logging, no session options
        return run_plot(args)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")
    for handler in logging.getLogger().handlers:
        handler.addFilter(ShownByTheBar())
    if args.per_block and getattr(args, "model", None) == "mlp":
        print("ddpwire: error: --per-block needs the transformer model", file=sys.stderr)
        return 2
    try:
        rounds(args)
        writable(getattr(args, "metrics", None), "--metrics")
        writable(getattr(args, "report", None), "--report")
        writable(getattr(args, "save", None), "--save")
        if args.command == "coordinator":
            with StopSignals() as stops:
                run_coordinator(args, stops=stops)
            return 0
        if args.command == "worker":
            return run_worker(args)
        from .demo import run_demo
        return run_demo(args, model=_model(args))
    except UsageError as exc:
        print(f"ddpwire: error: {exc}", file=sys.stderr)
        return 2
    except OptionError as exc:
        print(f"ddpwire: error: {exc.spelled(FLAGS)}", file=sys.stderr)
        return 2
    except (DdpwireError, OSError, ValueError) as exc:
        break_line()
        log.debug("%s", exc, exc_info=True)
        print(f"ddpwire: error: {_one_line(exc)}", file=sys.stderr)
        if isinstance(exc, WorkerLost) and not getattr(args, "elastic", False):
            print("ddpwire: a run ends when one of its workers leaves (stopped, killed, cut off "
                  "or silent past --timeout); the coordinator's --elastic lets the others go "
                  "on without it", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        break_line()
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"ddpwire: {'terminated' if signum == signal.SIGTERM else 'interrupted'}",
              file=sys.stderr)
        return 128 + signum


def _one_line(exc: BaseException) -> str:
    """The error as the command's one line."""
    text = str(exc)
    return without_frame_progress(text) if isinstance(exc, PeerLost) else text
