"""What protects the server from its clients, shared by the HTTP and gRPC front ends.

* **Bearer tokens** (:class:`Tokens`, from :mod:`gpuserve.service.auth`): with ``api_token``
  set, every endpoint but the health checks, ``/metrics`` and ``/v2/openapi.json`` needs
  ``Authorization: Bearer <api token>``. The repository's changing calls (load, unload,
  rollback, canary) need the management token instead (or the API token when no management
  token is set); the read-only repository calls (index, status) take either.
* **No file paths in answers** (:class:`Redactor`): messages built from load failures and
  configuration errors name files by absolute path, which is right for the log but tells a
  client how the machine is laid out. Before a message leaves the server, paths inside the
  model repository become repository-relative (``broken_model/1/model.pt``) and any other
  absolute path is cut to its last component (``.../serialization.py``). Logs keep the full
  paths.
* **A warning at start** (:func:`open_management_warning`): model management reachable from
  other machines with no token lets anyone load and unload models.
* **Names that cannot leave the repository** (:mod:`gpuserve.service.names`, checked by the
  inference service for every front end).
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from gpuserve.config import ServerConfig
from gpuserve.service.auth import Headers, Tokens, bearer_token
from gpuserve.service.names import check_model_name, check_override_paths, check_version_label

__all__ = [
    "OPEN_HTTP_PATHS",
    "Headers",
    "Redactor",
    "Tokens",
    "bearer_token",
    "check_model_name",
    "check_override_paths",
    "check_version_label",
    "open_management_warning",
]

#: Endpoints open without the API token (health probes, metrics, the API's description).
OPEN_HTTP_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics", "/v2/openapi.json"})

# An absolute POSIX path of at least two components, not glued to a word before it.
_PATH_PART = r"[^\s/\"'`,;:()<>\[\]{}|*?=]"
_ABSOLUTE_PATH = re.compile(rf"(?<![\w.~/\\-])/{_PATH_PART}+(?:/{_PATH_PART}*)+")
_URL_PATHS = ("/v2/", "/metrics/")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (the bind address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any address


def open_management_warning(config: ServerConfig) -> str | None:
    """The warning to log at start when model management is on, bound to an address other
    machines reach, with no token guarding it; else None."""
    if not config.management_enabled or is_loopback(config.host):
        return None
    if config.management_token is not None or config.api_token is not None:
        return None
    code = (
        "and files that run code may be uploaded with a load (--allow-model-upload-code)"
        if config.allow_model_upload_code
        else "(uploads of files that run code are refused without a token)"
    )
    return (
        f"model management (load, unload, rollback, canary) is enabled on {config.host}, "
        f"which other machines can reach, with no --management-token: anyone who reaches "
        f"the port can change what is served {code}; set --management-token, bind "
        "--host 127.0.0.1, or --disable-management"
    )


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
