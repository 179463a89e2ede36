"""The server's listening socket, bound before anything slow happens.

`tallow serve` binds here first, then loads the model (seconds to minutes) and hands the
socket to uvicorn: a port that is taken is one `error:` line at once (exit 2), where uvicorn
binding it itself reported `[Errno 98]` after the load, with exit 3. Only the standard
library is imported, so the check costs about 0.2 s (importing the server takes 1.5 s).
"""

from __future__ import annotations

import errno
import socket

from tallow.runtime.errors import TallowError


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is one error at
    once, not a uvicorn traceback after the load (uvicorn serves on this socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR, as uvicorn's own binding sets it: a restart need not wait for the
        # old connections' TIME_WAIT (it does not let two servers share a port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        hint = ""
        if e.errno == errno.EADDRINUSE:
            hint = " (another server holds it; pass another --port, or --port 0 for a free one)"
        raise TallowError(f"cannot listen on {host}:{port}: {why}{hint}") from None
    except OverflowError as e:  # a port outside 0-65535
        sock.close()
        raise TallowError(f"cannot listen on {host}:{port}: {e}") from None
    return sock
