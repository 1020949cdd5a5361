"""Running the app under uvicorn, with a graceful drain on SIGTERM / Ctrl-C.

First signal: the server drains. New generation requests get 503 (and /health turns 503,
so a load balancer stops routing here), requests already queued or running finish, and
when none is left the server exits with code 0. After ``shutdown_timeout`` seconds the
ones still running end with a 503 error (or an error event in their stream) instead.
A second signal does that at once: every request ends with its error (a stream with an
error event and ``[DONE]``) and the server exits 0 as soon as those are written. A third
stops waiting for slow clients.

Invariant: however it ends, the scheduler thread has stopped before ``run`` returns. A
thread still inside a torch operation while the interpreter finalizes aborts the process
("terminate called without an active exception", exit 134).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from ..errors import SpecdraftError
from .app import Service
from .scheduler import JobError


def in_passing_thread(fn, *args):
    """``fn(*args)`` run on a thread that ends when it returns; its value or exception is
    passed on. The server loads its engine this way.

    Why: OpenMP (PyTorch's CPU threads, libgomp) keeps a pool of workers for every thread
    that ever ran a parallel region, and once a process has more such workers than CPUs every
    pool stops spinning between regions, so each of the thousands of small ops of a decode
    step pays a futex wake-up. The engine runs on the scheduler thread; a model loaded on the
    main thread left the main thread's idle pool behind, and on the 2-vCPU EPYC every
    scheduler-thread forward took 1.9x as long (SmolLM2, bf16, one token: 82 vs 43 ms; the
    server then served plain decoding at 19 tok/s against `bench`'s 25). A thread that ends
    takes its pool with it."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 (re-raised on the calling thread)
            box["error"] = e

    worker = threading.Thread(target=run, name="specdraft-load", daemon=True)  # daemon: Ctrl-C still exits
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the drain described above.

    ``handle_exit`` runs inside a signal handler: it only sets attributes (no locks, which
    the interrupted thread might hold); the work happens in ``on_tick``, on the event loop,
    which uvicorn calls every 0.1 s.
    """

    def __init__(self, config: uvicorn.Config, service: Service, shutdown_timeout: float = 30.0):
        super().__init__(config)
        self.service = service
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: float | None = None
        self.signals = 0

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown, and
        # a drained server should exit 0, not die by the signal.
        self.signals += 1
        if self.signals == 1:
            self.service.draining = True
            self.drain_deadline = time.monotonic() + self.shutdown_timeout
        elif self.signals == 2:
            self.drain_deadline = float("-inf")  # the next tick aborts what is still running
        else:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            self._advance_drain()
        return await super().on_tick(counter)

    def _advance_drain(self) -> None:
        scheduler = self.service.scheduler
        scheduler.drain()
        if scheduler.idle():
            self.should_exit = True
        elif time.monotonic() > self.drain_deadline:
            scheduler.abort_all(JobError(JobError.SHUTDOWN, "the server shut down before the request finished"))
            self.should_exit = True  # uvicorn still waits for the responses to be written

    async def shutdown(self, sockets=None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            # uvicorn skips the lifespan's shutdown on force_exit; the thread must end anyway
            # (see the module's invariant). It ends after its current step.
            await asyncio.to_thread(self.service.scheduler.stop, None)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port), or a SpecdraftError saying why not.

    It listens at once: connections made before uvicorn starts wait in the backlog
    instead of being refused, so the address can be announced as soon as it is known.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SpecdraftError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SpecdraftError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_server(app, sock: socket.socket, shutdown_timeout: float = 30.0, log_level: str = "info",
                access_log: bool = True) -> DrainingServer:
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on")
    return DrainingServer(config, app.state.service, shutdown_timeout)
