"""The server's bearer tokens and whom they admit; shared by every front end.

With ``api_token`` set, the inference API needs ``Bearer <api token>``. The repository's
changing calls (load, unload, rollback, canary) need the management token instead (or the API
token when no management token is set); the read-only repository calls (index, status) take
either. Tokens are compared in constant time. Front ends only extract the token from their
wire (an ``Authorization`` header, ``authorization`` metadata) and ask here.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from gpuserve.config import ServerConfig

Headers = Iterable[tuple[bytes, bytes]]


def bearer_token(headers: Headers) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (names lower case), or None."""
    for key, value in headers:
        if key == b"authorization":
            scheme, _, given = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return given.strip()
            return None
    return None


class Tokens:
    """The server's bearer tokens and who they admit.

    Args:
        config: ``api_token`` and ``management_token``.
    """

    def __init__(self, config: ServerConfig) -> None:
        api = config.api_token
        management = config.management_token
        self.api = api.get_secret_value().encode() if api is not None else None
        self.management = management.get_secret_value().encode() if management is not None else None

    @staticmethod
    def _matches(given: bytes | None, *tokens: bytes | None) -> bool:
        if given is None:
            return False
        # compare with every token whatever the outcome, so timing tells nothing
        results = [hmac.compare_digest(given, t) for t in tokens if t is not None]
        return any(results)

    def api_token_ok(self, given: bytes | None) -> bool:
        """Whether bearer token ``given`` may use the inference API (always, without an API
        token)."""
        return self.api is None or self._matches(given, self.api)

    def read_token_ok(self, given: bytes | None) -> bool:
        """Whether ``given`` may read the repository (index, status): either token."""
        if self.api is None:
            return True
        return self._matches(given, self.api, self.management)

    def management_token_ok(self, given: bytes | None) -> bool:
        """Whether ``given`` may change what is served: the management token, else the API
        token, else anyone (management itself may still be disabled)."""
        wanted = self.management if self.management is not None else self.api
        return wanted is None or self._matches(given, wanted)

    def allows_api(self, headers: Headers) -> bool:
        """:meth:`api_token_ok` for the bearer token in ``headers``."""
        return self.api is None or self.api_token_ok(bearer_token(headers))

    def allows_read(self, headers: Headers) -> bool:
        """:meth:`read_token_ok` for the bearer token in ``headers``."""
        return self.api is None or self.read_token_ok(bearer_token(headers))

    def allows_management(self, headers: Headers) -> bool:
        """:meth:`management_token_ok` for the bearer token in ``headers``."""
        return self.management_token_ok(bearer_token(headers))
