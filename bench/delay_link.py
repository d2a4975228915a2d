"""A link with real delay in front of a test host's sshd, for the latency benchmarks.

netem (`tc qdisc ... netem delay`) is what a site would use, and it is what issue 48 asks for,
but the CI machine's kernel has no sch_netem (`tc qdisc add ... netem` answers "Specified qdisc
kind is unknown"; no module to load). So the delay is made in user space: a TCP relay on a
loopback address of the test host's pool that holds every chunk of bytes for half the round
trip in each direction (order kept), and holds each new connection for one round trip before
it is made (the SYN / SYN-ACK a real link would delay). Only connections to that relay are
delayed: the test host itself, and everything else on this machine, are untouched. For SSH,
whose cost at latency is its request/answer round trips, this is the delay that matters; what
it does not model (bandwidth, loss, TCP's window growth) is no part of a no-op's few kilobytes.

    with DelayLink("127.0.5.200", ("127.0.5.10", 22), rtt_ms=25) as link:
        ... ssh -p link.port root@127.0.5.200 ...
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time


class DelayLink:
    def __init__(self, listen_addr: str, target: tuple[str, int], rtt_ms: float) -> None:
        self.listen_addr, self.target, self.rtt_ms = listen_addr, target, rtt_ms
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def set_rtt(self, rtt_ms: float) -> None:
        """Change the round trip for connections made from now on."""
        self.rtt_ms = rtt_ms

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((time.monotonic() + delay, data))
                if not data:
                    break
            await task
        except (ConnectionError, OSError):
            task.cancel()
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rtt = self.rtt_ms / 1000
        await asyncio.sleep(rtt)  # the connection's handshake crosses the link once each way
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer, rtt / 2), self._pump(up_reader, writer, rtt / 2),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the link closing with this connection open: asyncio's stream callback chokes on a re-raise
        for w in (writer, up_writer):
            w.close()

    def __enter__(self) -> DelayLink:
        self._thread.start()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.listen_addr, 0))
        self.port = sock.getsockname()[1]
        fut = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, sock=sock, backlog=256), self._loop)
        self._server = fut.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if self._server:
                self._server.close()
            for task in asyncio.all_tasks():  # connections still open (a pump waiting for bytes)
                if task is not asyncio.current_task():
                    task.cancel()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
