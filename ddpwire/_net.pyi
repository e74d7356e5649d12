"""Stubs for the compiled socket layer (ddpwire/_net.pyx)."""
import socket
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Type, Union

from .errors import PeerLost

_Buffer = Any  # any object with the buffer protocol

class Connection:
    sock: socket.socket
    fd: int
    peer_id: Optional[int]
    lost: Type[PeerLost]
    peer_name: str
    def __init__(self, sock: socket.socket, *, peer_id: Optional[int] = ...,
                 lost: Type[PeerLost] = ..., peer_name: str = ...) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def recv_into(self, buf: _Buffer, timeout: float, *, step: Optional[int] = ...,
                  what: str = ...) -> None: ...
    def recv_exact(self, n: int, timeout: float, *, step: Optional[int] = ...,
                   what: str = ...) -> bytes: ...
    def send_parts(self, parts: Iterable[Optional[_Buffer]], timeout: float, *,
                   step: Optional[int] = ..., what: str = ...) -> None: ...

class FrameHead:
    tag: int
    message_type: str
    step: int
    worker_id: int
    block_idx: int
    num_blocks: int
    component: int
    component_sizes: List[int]
    gradient_count: int
    tail_len: int

def send_many(conns: List[Connection], parts: Iterable[Optional[_Buffer]], timeout: float, *,
              step: Optional[int] = ..., what: str = ...) -> None: ...
def reduce_stream(conns: List[Connection], out: _Buffer, tail_len: int, timeout: float, *,
                  ring_bytes: int = ..., socket_threads: bool = ..., step: Optional[int] = ...,
                  what: str = ...
                  ) -> Tuple[List[bytes], Optional[List[Tuple[int, float]]]]: ...
def allreduce_stream(conns: List[Connection], out: _Buffer, tail_len: int, head: _Buffer,
                     make_tail: Callable[[List[bytes]], _Buffer], timeout: float, *,
                     ring_bytes: int = ..., socket_threads: bool = ..., step: Optional[int] = ...,
                  what: str = ...
                     ) -> Tuple[List[bytes], Optional[List[Tuple[int, float]]]]: ...

class Exchange:
    sent: int
    done: bool
    def __init__(self, conn: Connection, parts: Iterable[Optional[_Buffer]], timeout: float, *,
                 step: Optional[int] = ..., what: str = ..., send_thread: bool = ...) -> None: ...
    def recv_into(self, *bufs: _Buffer, what: str = ...) -> None: ...
    def finish(self) -> None: ...
    def abandon(self) -> None: ...

def read_frame_head(conn: Connection, timeout: float, max_frame: int, *,
                    step: Optional[int] = ..., what: str = ...) -> Any: ...
def exchange_frame_head(exchange: "Exchange", max_frame: int, *, peer_id: Optional[int] = ...,
                        step: Optional[int] = ..., what: str = ...) -> Any: ...
def decode_tail(tag: int, tail: bytes) -> Tuple[float, int, int, float]: ...
def read_tail(conn: Connection, head: FrameHead, timeout: float, *,
              step: Optional[int] = ...) -> Tuple[float, int, int, float]: ...
