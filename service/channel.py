"""What an instance of several and the parent process tell each other (service/instances.py).

Kept apart from both, so that the serving side (state.py, server.py) and the supervising side
(instances.py) import it without importing each other.

Instance -> parent, one byte each on the instance's Unix socket pair: ``R`` ready, ``N`` serving but
not ready, ``C`` a connection closed, ``H`` a heartbeat (the event loop is turning), ``X`` the instance
is leaving for good (its device failed) and wants to be replaced. Parent -> instance: connections
(their file descriptors) with a one-byte ``c`` each.
"""

from __future__ import annotations

MSG_READY, MSG_NOT_READY, MSG_CLOSED = ord("R"), ord("N"), ord("C")
MSG_HEARTBEAT, MSG_LEAVING = ord("H"), ord("X")
#: an instance sends a heartbeat this often while its event loop turns
HEARTBEAT_S = 0.5

__all__ = ["MSG_READY", "MSG_NOT_READY", "MSG_CLOSED", "MSG_HEARTBEAT", "MSG_LEAVING", "HEARTBEAT_S"]
