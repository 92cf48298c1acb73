"""Client of the lbagent load-balancing agent.

    import lbagent
    client = lbagent.Client()            # heartbeat from $LBAGENT_HEARTBEAT or /run/lbagent
    client.register(100, 1)              # pull the route before first use
    with client.call(100, 1) as (ip, port):
        ...                              # call the node; success is reported,
                                         # an exception reports a failure with its tcost

Errors are subclasses of LbError, each with `code` (the tool commands' exit
status) and `kind` (a short name).
"""

import time
from contextlib import contextmanager

from ._native import (
    AgentDown,
    BadArgument,
    BadResponse,
    LbError,
    NoSuchModule,
    Overloaded,
    Rejected,
    StaticRoutes,
    Timeout,
)
from ._native import Client as _NativeClient
from ._native import decode_level, encode_level

__all__ = [
    "Client",
    "LbError",
    "NoSuchModule",
    "Overloaded",
    "Rejected",
    "AgentDown",
    "StaticRoutes",
    "Timeout",
    "BadResponse",
    "BadArgument",
    "encode_level",
    "decode_level",
]

#: The retcode `call` reports when the block raises.
FAILURE_RETCODE = -1


class Client(_NativeClient):
    """A client of the local agent (see the package documentation)."""

    @contextmanager
    def call(self, modid, cmdid, timeout=1.0, business_priority=0, user_priority=0, user_id=None):
        """get_host, then report when the block ends: success, or failure
        (retcode FAILURE_RETCODE) with the measured tcost when it raises. The
        exception propagates."""
        host = self.get_host(modid, cmdid, timeout, business_priority, user_priority, user_id)
        t0 = time.monotonic()
        try:
            yield host
        except BaseException:
            tcost = int((time.monotonic() - t0) * 1000)
            self.report(modid, cmdid, host, FAILURE_RETCODE, tcost)
            raise
        tcost = int((time.monotonic() - t0) * 1000)
        self.report(modid, cmdid, host, 0, tcost)
