from contextlib import AbstractContextManager
from os import PathLike
from typing import List, Optional, Tuple, TypedDict, Union

FAILURE_RETCODE: int

Host = Tuple[str, int]

#: An admission level (B, U), each 1..=128.
Level = Tuple[int, int]

def encode_level(level: Optional[Level]) -> bytes: ...
def decode_level(data: bytes) -> Optional[Level]: ...

class RouteNode(TypedDict):
    ip: str
    port: int
    weight: int
    overloaded: bool
    vsucc: int
    verr: int
    rsucc: int
    rerr: int
    contin_succ: int
    contin_err: int
    version: int

class LbError(Exception):
    code: int
    kind: str

class NoSuchModule(LbError): ...
class Overloaded(LbError): ...
class Rejected(LbError): ...
class AgentDown(LbError): ...
class StaticRoutes(LbError): ...
class Timeout(LbError): ...
class BadResponse(LbError): ...
class BadArgument(LbError): ...

class Client:
    def __init__(
        self,
        heartbeat: Optional[Union[str, PathLike[str]]] = None,
        cache: bool = False,
        snapshot: Optional[Union[str, PathLike[str]]] = None,
        user_hash_seed: Optional[int] = None,
        user_key_period_s: Optional[int] = None,
    ) -> None: ...
    def get_host(
        self,
        modid: int,
        cmdid: int,
        timeout: float = 1.0,
        business_priority: int = 0,
        user_priority: int = 0,
        user_id: Optional[Union[bytes, str]] = None,
    ) -> Host: ...
    def get_host_source(
        self,
        modid: int,
        cmdid: int,
        timeout: float = 1.0,
        business_priority: int = 0,
        user_priority: int = 0,
        user_id: Optional[Union[bytes, str]] = None,
    ) -> Tuple[str, int, str]: ...
    def get_host_keyed(
        self,
        modid: int,
        cmdid: int,
        key: Union[bytes, str],
        timeout: float = 1.0,
    ) -> Tuple[str, int]: ...
    def get_host_selecting(
        self,
        modid: int,
        cmdid: int,
        select: str,
        timeout: float = 1.0,
    ) -> Tuple[str, int]: ...
    def user_priority(self, user_id: Union[bytes, str]) -> int: ...
    def report(
        self,
        modid: int,
        cmdid: int,
        host: Host,
        retcode: int = 0,
        tcost_ms: int = 0,
        downstream_level: Optional[Level] = None,
    ) -> None: ...
    def register(self, modid: int, cmdid: int, timeout: float = 1.0) -> int: ...
    def get_route(self, modid: int, cmdid: int, timeout: float = 1.0) -> List[RouteNode]: ...
    def flush(self) -> None: ...
    def call(
        self,
        modid: int,
        cmdid: int,
        timeout: float = 1.0,
        business_priority: int = 0,
        user_priority: int = 0,
        user_id: Optional[Union[bytes, str]] = None,
    ) -> AbstractContextManager[Host]: ...
