"""OCR client: send image files (or a rendered demo image) to the ``ocr`` model.

    python examples/ocr/client.py [--url localhost:8000] [IMAGE ...]

Each image goes as its encoded file bytes (IMAGE BYTES [1, 1], binary tensor extension);
the recognised lines are printed, one per line, and with ``--lines`` their boxes and scores.
Needs ``tritonclient[http]`` and Pillow.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np

DEMO_LINES = ("Hello from gpuserve", "Invoice 2026-0042", "Total: 129.50 EUR")


def demo_image(lines: tuple[str, ...] = DEMO_LINES, size: int = 36) -> bytes:
    """A PNG of black text lines on white, drawn with Pillow's built-in font."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=size)
    image = Image.new("RGB", (24 * size, (len(lines) + 1) * 2 * size), "white")
    draw = ImageDraw.Draw(image)
    for index, line in enumerate(lines):
        draw.text((size, size + index * 2 * size), line, fill="black", font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def recognise(url: str, images: list[bytes], model: str = "ocr") -> list[dict]:
    """OCR of each encoded image: ``[{"text": str, "lines": [{"text", "score", "box"}]}]``."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    data = np.array([[image] for image in images], dtype=object)
    tensor = httpclient.InferInput("IMAGE", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data, binary_data=True)
    outputs = [
        httpclient.InferRequestedOutput(name, binary_data=True) for name in ("TEXT", "LINES")
    ]
    result = client.infer(model, [tensor], outputs=outputs)
    return [
        {"text": text.decode(), "lines": json.loads(lines)}
        for (text,), (lines,) in zip(result.as_numpy("TEXT"), result.as_numpy("LINES"), strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", type=Path, help="image files (default: a demo)")
    parser.add_argument("--url", default="localhost:8000", help="server host:port (HTTP)")
    parser.add_argument("--lines", action="store_true", help="also print boxes and scores")
    args = parser.parse_args(argv)
    images = [path.read_bytes() for path in args.images] or [demo_image()]
    for name, page in zip(args.images or ["demo"], recognise(args.url, images), strict=True):
        print(f"== {name}")
        print(page["text"])
        if args.lines:
            for line in page["lines"]:
                print(f"   {line['box']} {line['score']:.3f} {line['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
