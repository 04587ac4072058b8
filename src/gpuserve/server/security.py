"""What protects the server from its clients, shared by the HTTP and gRPC front ends.

* **Bearer tokens** (:class:`Tokens`): with ``api_token`` set, every endpoint but the health
  checks, ``/metrics`` and ``/v2/openapi.json`` needs ``Authorization: Bearer <api token>``.
  The repository's changing calls (load, unload, rollback, canary) need the management token
  instead (or the API token when no management token is set); the read-only repository calls
  (index, status) take either. Tokens are compared in constant time.
* **No file paths in answers** (:class:`Redactor`): messages built from load failures and
  configuration errors name files by absolute path, which is right for the log but tells a
  client how the machine is laid out. Before a message leaves the server, paths inside the
  model repository become repository-relative (``broken_model/1/model.pt``) and any other
  absolute path is cut to its last component (``.../serialization.py``). Logs keep the full
  paths.
* **Names that cannot leave the repository** (:func:`check_model_name`,
  :func:`check_version_label`, :func:`check_override_paths`): a model name is one folder
  name of the repository, a version is ASCII digits; a configuration sent with a load request
  cannot point a model at files outside its version folder.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from gpuserve.config import ServerConfig
from gpuserve.errors import InvalidInputError, ModelNotFoundError

#: Endpoints open without the API token (health probes, metrics, the API's description).
OPEN_HTTP_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics", "/v2/openapi.json"})

Headers = Iterable[tuple[bytes, bytes]]


def bearer_token(headers: Headers) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
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

    def allows_api(self, headers: Headers) -> bool:
        """Whether a request may use the inference API (always, without an API token)."""
        return self.api is None or self._matches(bearer_token(headers), self.api)

    def allows_read(self, headers: Headers) -> bool:
        """Whether a request may read the repository (index, status): either token."""
        if self.api is None:
            return True
        return self._matches(bearer_token(headers), self.api, self.management)

    def allows_management(self, headers: Headers) -> bool:
        """Whether a request may change what is served: the management token, else the API
        token, else anyone (management itself may still be disabled)."""
        wanted = self.management if self.management is not None else self.api
        return wanted is None or self._matches(bearer_token(headers), wanted)


# An absolute POSIX path of at least two components, not glued to a word before it.
_PATH_PART = r"[^\s/\"'`,;:()<>\[\]{}|*?=]"
_ABSOLUTE_PATH = re.compile(rf"(?<![\w.~/\\-])/{_PATH_PART}+(?:/{_PATH_PART}*)+")
_URL_PATHS = ("/v2/", "/metrics/")


class Redactor:
    """Takes file paths out of messages meant for clients (see the module docstring).

    Args:
        repository: The model repository folder (as configured; its resolved form and
            absolute form are recognised too).
    """

    def __init__(self, repository: Path) -> None:
        forms = {str(repository), os.path.abspath(repository), os.path.realpath(repository)}
        forms = {f.rstrip("/") for f in forms if f.rstrip("/")}
        self.absolute_roots = sorted((f for f in forms if f.startswith("/")), key=len, reverse=True)
        relative = [f for f in forms if not f.startswith("/")]
        self._relative = (
            re.compile(r"(?<![\w./\\-])(?:" + "|".join(re.escape(f) for f in relative) + r")/")
            if relative
            else None
        )

    def _path(self, match: re.Match[str]) -> str:
        path = match.group(0)
        for root in self.absolute_roots:
            if path == root:
                return "<model repository>"
            if path.startswith(root + "/"):
                return path[len(root) + 1 :] or "<model repository>"
        if path.startswith(_URL_PATHS):
            return path
        name = path.rstrip("/").rsplit("/", 1)[-1]
        return f".../{name}"

    def text(self, message: str) -> str:
        """``message`` without file paths."""
        if "/" not in message:
            return message
        if self._relative is not None:
            message = self._relative.sub("", message)
        return _ABSOLUTE_PATH.sub(self._path, message)

    def json(self, payload: bytes) -> bytes:
        """A UTF-8 JSON document without file paths in its strings."""
        if b"/" not in payload:
            return payload
        return self.text(payload.decode()).encode()


_MODEL_NAME_HINT = (
    "a model name is the name of one folder of the model repository: no '/', '\\', NUL or "
    "control characters, not empty and not starting with '.'"
)


def check_model_name(name: str) -> None:
    """Refuse a model name that could name anything but one folder of the repository
    (``..``, ``a/b``, an absolute path, a hidden folder, NUL).

    Raises:
        InvalidInputError: the name is not a plain folder name.
    """
    if (
        not name
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise InvalidInputError(f"invalid model name {name!r}: {_MODEL_NAME_HINT}")


def check_version_label(name: str, version: str | None) -> None:
    """Refuse a version label that is not ASCII digits (``²`` is a digit to Python's
    ``str.isdigit`` but not to ``int``).

    Raises:
        ModelNotFoundError: the model has no such version.
    """
    if version is not None and not (version.isascii() and version.isdigit()):
        raise ModelNotFoundError(
            f"model '{name}' has no version {version!r} (versions are positive integers)"
        )


def check_override_paths(config: dict[str, Any]) -> None:
    """Refuse a configuration sent with a load request that points at files outside the
    model's version folder (``huggingface.model_dir`` absolute or with ``..``).

    Raises:
        InvalidInputError: names the field and the value.
    """
    section = config.get("huggingface")
    if not isinstance(section, dict):
        return
    model_dir = section.get("model_dir")
    if not isinstance(model_dir, str):
        return
    path = PurePosixPath(model_dir.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        raise InvalidInputError(
            f"field 'huggingface.model_dir' {model_dir!r}: a configuration sent with a load "
            "request may only name a folder inside the model's version folder (relative, "
            "without '..'); put other paths in config.yaml"
        )
