"""What an instance of several and the parent process tell each other (service/instances.py).

Kept apart from both, so that the serving side (state.py, server.py) and the supervising side
(instances.py) import it without importing each other.

Instance -> parent, one byte each on the instance's Unix socket pair: ``R`` ready, ``N`` serving but
not ready, ``C`` a connection closed, ``H`` a heartbeat (the event loop is turning), ``X`` the instance
is leaving for good (its device failed) and wants to be replaced, ``T`` a connection taken (the parent
keeps its copy of each connection until then, and hands the ones an instance never took to another). Parent -> instance: connections
(their file descriptors) with a one-byte ``c`` each, and whether every instance is ready.
"""

from __future__ import annotations

MSG_READY, MSG_NOT_READY, MSG_CLOSED = ord("R"), ord("N"), ord("C")
MSG_HEARTBEAT, MSG_LEAVING, MSG_TAKEN = ord("H"), ord("X"), ord("T")
#: an instance sends a heartbeat this often while its event loop turns
HEARTBEAT_S = 0.5
#: parent -> instance: every instance is ready (``A``), or not (``P``, then a reason: UTF-8 up to ``\n``)
MSG_ALL_READY, MSG_SHORT = ord("A"), ord("P")
#: the exit status of an instance that left because its device failed (it is restarted)
EXIT_LEFT = 3



def recv_ready(sock, size: int) -> bytes | None:
    """What a non-blocking socket has for us, up to ``size`` bytes: ``None`` when nothing is there yet (or the call
    was interrupted), ``b""`` when the peer closed it or it failed (every caller treats both as the end)."""
    try:
        return sock.recv(size)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


__all__ = ["recv_ready", "MSG_READY", "MSG_NOT_READY", "MSG_CLOSED", "MSG_HEARTBEAT", "MSG_LEAVING", "MSG_TAKEN", "HEARTBEAT_S", "MSG_ALL_READY",
           "MSG_SHORT", "EXIT_LEFT"]
