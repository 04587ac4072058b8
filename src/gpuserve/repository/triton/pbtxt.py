"""Reading Triton's protobuf text format (``config.pbtxt``) into plain field trees.

gpuserve ships only the part of Triton's ``ModelConfig`` message that it serves, so a
``config.pbtxt`` is not parsed into that message (``text_format`` would stop at the first
field it lacks, with no chance to say *why* the field is refused). It is read here, with
``google.protobuf.text_format``'s tokenizer, into a schema-free tree that
:mod:`gpuserve.repository.triton.config` maps, field by field, onto gpuserve's
:class:`~gpuserve.config.ModelConfig`, naming every field it cannot serve.

The tree: a message is a ``dict`` of field name -> ``list`` of values (a field may repeat);
a value is a nested message (``dict``), a ``str`` (string, or an enum name such as
``TYPE_FP32``), an ``int``, a ``float`` or a ``bool``. ``dims: [1, 16]`` and ``dims: 1
dims: 16`` read the same.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from gpuserve.errors import ConfigError

#: A scalar of the text format: string/enum name, integer, float or bool.
Scalar = str | int | float | bool
#: A message: field name -> its values in file order.
Message = dict[str, list["Value"]]
Value = Scalar | Message

_CLOSE = {"{": "}", "<": ">"}


def parse_text(text: str, path: Path) -> Message:
    """Parse protobuf text format into a field tree (see the module docstring).

    Args:
        text: The file's content.
        path: The file, for error messages.

    Raises:
        ConfigError: not valid text format; the message names the file, line and column.
    """
    tokenizer = text_format.Tokenizer(text.splitlines())
    try:
        return _message(tokenizer, None)
    except text_format.ParseError as err:
        raise ConfigError(f"{path}: not valid protobuf text format: {err}") from None


def _message(tok: text_format.Tokenizer, close: str | None) -> Message:
    fields: Message = {}
    while True:
        if close is not None and tok.TryConsume(close):
            return fields
        if tok.AtEnd():
            if close is not None:
                raise tok.ParseError(f"expected '{close}' before the end of the file")
            return fields
        name = tok.ConsumeIdentifier()
        values = fields.setdefault(name, [])
        has_colon = tok.TryConsume(":")
        if tok.TryConsume("["):
            if not tok.TryConsume("]"):
                while True:
                    values.append(_value(tok, has_colon=True))
                    if tok.TryConsume("]"):
                        break
                    tok.Consume(",")
        else:
            values.append(_value(tok, has_colon))
        # Fields may be separated by ',' or ';' as well as by whitespace.
        if not tok.TryConsume(","):
            tok.TryConsume(";")


def _value(tok: text_format.Tokenizer, has_colon: bool) -> Value:
    for opening, closing in _CLOSE.items():
        if tok.TryConsume(opening):
            return _message(tok, closing)
    if not has_colon:
        raise tok.ParseError(f"expected ':' or '{{' before {tok.token!r}")
    token = tok.token
    if token[:1] in ("'", '"'):
        return str(tok.ConsumeString())
    tok.NextToken()
    if token in ("true", "True", "t"):
        return True
    if token in ("false", "False", "f"):
        return False
    try:
        return int(token, 0)
    except ValueError:
        pass
    try:
        return float(token)
    except ValueError:
        pass
    if token and (token[0].isalpha() or token[0] == "_"):
        return token  # an enum value name
    raise tok.ParseError(f"unexpected {token!r}")


def read_pbtxt(path: Path) -> Message:
    """Read and parse ``path`` (see :func:`parse_text`).

    Raises:
        ConfigError: unreadable file or invalid text format.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text: {err}") from None
    return parse_text(text, path)
