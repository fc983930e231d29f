"""Procedural talking faces: an identity sampled from a seed, drawn anti-aliased with Pillow.

Who calls what: :class:`models.avatars.dataset.AvatarRenderer` owns one :class:`FaceRenderer` per
identity and calls :meth:`FaceRenderer.render` once per frame with the pose, mouth and blink values of
that frame; ``bench.quality`` uses the same path for ground-truth renders.

How it stays fast (> 200 frames/s at 256x256 on one core): everything that does not move relative to
the head (face, ears, hair, nose, brows, accessories) is drawn once per identity at 2x into RGBA
layers; per frame only the eyes and the mouth are drawn at 2x onto a copy of the head layer, which is
box-reduced to 1x, placed with one bilinear affine warp (the head pose) and alpha-composited over the
per-identity background (which also holds the neck and shoulders, so they do not move with the head).

Ground truth returned with every frame: the mouth box and face box in output pixels (axis-aligned
boxes around the transformed shapes), so metrics can look at the right pixels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

SS = 2  # supersampling factor of the per-identity layers

_SKIN = np.array([(255, 224, 196), (241, 194, 125), (224, 172, 105), (198, 134, 66),
                  (141, 85, 36), (92, 56, 38)], dtype=np.float64)
_HAIR = [(20, 18, 16), (60, 40, 25), (110, 75, 40), (200, 170, 110), (160, 70, 30), (150, 150, 150),
         (235, 230, 220), (40, 60, 140), (190, 80, 140)]
_EYES = [(70, 45, 25), (60, 110, 170), (70, 120, 70), (110, 110, 120), (120, 90, 40)]
_ACCENT = [(200, 40, 40), (40, 90, 200), (30, 140, 80), (230, 190, 40), (120, 60, 160), (30, 30, 30),
           (240, 240, 240), (230, 120, 30)]
_EARRINGS = [(230, 190, 60), (200, 200, 210)]  # gold, silver


def _rgb(c: np.ndarray | tuple[float, ...]) -> tuple[int, int, int]:
    a = np.clip(np.round(np.asarray(c, dtype=np.float64)), 0, 255).astype(int)
    return int(a[0]), int(a[1]), int(a[2])


def _luma(c: tuple[int, int, int]) -> float:
    return 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]


# Every region the renderer draws, in label order (0 = not part of the head: background, neck,
# shoulders). ``FaceRenderer.region_masks`` returns one coverage map per name.
REGIONS: tuple[str, ...] = ("background", "skin", "hair", "brows", "nose", "hat", "earrings", "glasses",
                            "eyes", "lips", "mouth")
ACCESSORIES: tuple[str, ...] = ("glasses", "earrings", "hat")

Fill = tuple[int, ...] | int


def _colour(region: str, rgba: tuple[int, ...]) -> Fill:
    """The painter of frames: every shape in its colour (label painters return the region's index)."""
    return rgba


def _label(region: str, rgba: tuple[int, ...]) -> Fill:
    return REGIONS.index(region)


@dataclass(frozen=True)
class FaceIdentity:
    """Everything that makes one person look like themselves; constant over a render. Sizes are
    fractions of the frame size so the same identity draws at any resolution."""

    seed: int
    bg_kind: int  # 0 vertical gradient, 1 horizontal gradient, 2 radial, 3 stripes, 4 soft checker
    bg_a: tuple[int, int, int]
    bg_b: tuple[int, int, int]
    shirt: tuple[int, int, int]
    skin: tuple[int, int, int]
    face_cx: float
    face_cy: float
    face_rx: float
    face_ry: float
    jaw: float  # 0 round chin .. 1 narrow chin
    hair: tuple[int, int, int]
    hair_style: int  # 0 bald, 1 short, 2 long, 3 bun, 4 fringe
    eye_color: tuple[int, int, int]
    eye_dx: float
    eye_y: float
    eye_rx: float
    eye_ry: float
    brow_thick: float
    brow_tilt: float
    nose_style: int  # 0 line, 1 nostrils, 2 wide
    mouth_y: float
    mouth_w: float
    lips: tuple[int, int, int]
    glasses: int  # 0 none, 1 round, 2 square
    glasses_color: tuple[int, int, int]
    earrings: tuple[int, int, int] | None
    hat: tuple[int, int, int] | None

    @staticmethod
    def sample(seed: int) -> FaceIdentity:
        rng = np.random.default_rng([seed, 1234])
        u = rng.uniform(0, len(_SKIN) - 1)
        i = int(u)
        skin = _SKIN[i] * (1 - (u - i)) + _SKIN[min(i + 1, len(_SKIN) - 1)] * (u - i)
        skin = skin + rng.uniform(-8, 8, 3)
        hue = rng.uniform(0, 1, 3)
        bg_a = _rgb(60 + 170 * hue)
        bg_b = _rgb(np.asarray(bg_a) * rng.uniform(0.55, 0.95) + rng.uniform(-25, 25, 3))
        lips = _rgb(skin * 0.72 + np.array([45.0, 0.0, 5.0]))
        return FaceIdentity(
            seed=seed,
            bg_kind=int(rng.integers(5)), bg_a=bg_a, bg_b=bg_b,
            shirt=_ACCENT[int(rng.integers(len(_ACCENT)))],
            skin=_rgb(skin),
            face_cx=0.5 + rng.uniform(-0.03, 0.03), face_cy=0.45 + rng.uniform(-0.02, 0.02),
            face_rx=rng.uniform(0.19, 0.25), face_ry=rng.uniform(0.26, 0.31),
            jaw=rng.uniform(0, 1),
            hair=_HAIR[int(rng.integers(len(_HAIR)))], hair_style=int(rng.integers(5)),
            eye_color=_EYES[int(rng.integers(len(_EYES)))],
            eye_dx=rng.uniform(0.075, 0.1), eye_y=rng.uniform(-0.07, -0.03),
            eye_rx=rng.uniform(0.032, 0.045), eye_ry=rng.uniform(0.016, 0.026),
            brow_thick=rng.uniform(0.008, 0.018), brow_tilt=rng.uniform(-0.012, 0.012),
            nose_style=int(rng.integers(3)),
            mouth_y=rng.uniform(0.13, 0.17), mouth_w=rng.uniform(0.055, 0.075), lips=lips,
            glasses=int(rng.choice(3, p=[0.65, 0.2, 0.15])),
            glasses_color=_ACCENT[int(rng.integers(len(_ACCENT)))],
            earrings=_rgb(rng.choice(_EARRINGS)) if rng.random() < 0.3 else None,
            hat=_ACCENT[int(rng.integers(len(_ACCENT)))] if rng.random() < 0.2 else None,
        )

    @property
    def accessories(self) -> tuple[str, ...]:
        """The accessories this identity wears, a subset of :data:`ACCESSORIES` in that order."""
        worn = {"glasses": bool(self.glasses), "earrings": self.earrings is not None, "hat": self.hat is not None}
        return tuple(a for a in ACCESSORIES if worn[a])

    def without(self, accessory: str) -> FaceIdentity:
        """The same person without one accessory (what lies beneath it is drawn instead): the
        counterfactual ``bench.fidelity`` decides accessory presence against."""
        if accessory not in ACCESSORIES:
            raise ValueError(f"accessory={accessory!r}: must be one of {ACCESSORIES}")
        return replace(self, **{"glasses": 0} if accessory == "glasses" else {accessory: None})

    def with_accessory(self, accessory: str, style: int) -> FaceIdentity:
        """The same person wearing ``accessory`` in style ``style`` of :data:`ACCESSORY_STYLES` (what
        :meth:`sample` can draw: glasses round or square in an accent colour, gold or silver
        earrings, a hat in an accent colour), replacing the identity's own if it has one: the
        counterfactuals ``bench.fidelity`` decides *false* presence against (an accessory drawn on a
        reference that lacks it, in whatever colour)."""
        if accessory not in ACCESSORIES:
            raise ValueError(f"accessory={accessory!r}: must be one of {ACCESSORIES}")
        styles = ACCESSORY_STYLES[accessory]
        if not 0 <= style < len(styles):
            raise ValueError(f"style={style}: {accessory} has styles 0..{len(styles) - 1} (ACCESSORY_STYLES)")
        return replace(self, **styles[style])


# Every way :meth:`FaceIdentity.sample` can draw each accessory, as the fields it sets, in a fixed
# order (:meth:`FaceIdentity.with_accessory` takes an index into these).
ACCESSORY_STYLES: dict[str, tuple[dict[str, Any], ...]] = {
    "glasses": tuple({"glasses": shape, "glasses_color": c} for shape in (1, 2) for c in _ACCENT),
    "earrings": tuple({"earrings": c} for c in _EARRINGS),
    "hat": tuple({"hat": c} for c in _ACCENT),
}


@dataclass(frozen=True)
class HeadPose:
    """Head pose relative to the reference: translation in output pixels, rotation in degrees,
    scale factor; applied about the face centre."""

    dx: float = 0.0
    dy: float = 0.0
    angle_deg: float = 0.0
    scale: float = 1.0


Box = tuple[int, int, int, int]  # x0, y0, x1, y1 (exclusive), output pixels


class FaceRenderer:
    """Draws one identity at ``size`` x ``size``. Build once per identity (a few ms), then
    :meth:`render` per frame. Holds only per-identity layers; keeps no frames."""

    MAX_OPEN = 0.075  # mouth interior height at opening 1, fraction of the frame size

    def __init__(self, identity: FaceIdentity, size: int = 256) -> None:
        self.identity = identity
        self.size = size
        self._s2 = size * SS
        self._ox = self._oy = 0.0  # origin of the layer being drawn, in 2x pixels (see _px)
        idn = identity
        self._center = (idn.face_cx * size, idn.face_cy * size)
        self._interior = _rgb(np.asarray(idn.skin) * 0.16 + np.array([14.0, 2.0, 4.0]))
        self._background = self._draw_background()
        head2x = self._draw_head()
        overlay = self._draw_overlay()
        # Per frame only the feature region (eyes, glasses, mouth) is redrawn at 2x and reduced; the
        # rest of the head is reduced once. Regions are kept on even 2x coordinates so they align at 1x.
        x0, y0 = self._px(-idn.eye_dx - idn.eye_rx - 0.035, idn.eye_y - idn.eye_ry - 0.04)
        x1, y1 = self._px(idn.eye_dx + idn.eye_rx + 0.035, idn.mouth_y + self.MAX_OPEN / 2 + 0.03)
        self._feat = (int(x0) // 2 * 2, int(y0) // 2 * 2, int(x1 + 2) // 2 * 2, int(y1 + 2) // 2 * 2)
        self._feat_base = head2x.crop(self._feat)
        self._feat_overlay = overlay.crop(self._feat) if overlay is not None else None
        if overlay is not None:
            head2x.alpha_composite(overlay)
        bbox = head2x.getbbox() or (0, 0, self._s2, self._s2)
        self._hbox = (bbox[0] // 2 * 2, bbox[1] // 2 * 2, (bbox[2] + 1) // 2 * 2, (bbox[3] + 1) // 2 * 2)
        self._head1x = head2x.crop(self._hbox).reduce(SS)
        self._label_layers: tuple[Image.Image, Image.Image | None] | None = None  # drawn on first use

    # ---- per-identity layers (drawn once) -------------------------------------------------------
    def _px(self, fx: float, fy: float) -> tuple[float, float]:
        """Fractions of the frame (relative to the face centre) -> 2x layer pixels."""
        i = self.identity
        return ((i.face_cx + fx) * self._s2 - self._ox, (i.face_cy + fy) * self._s2 - self._oy)

    def _ell(self, d: ImageDraw.ImageDraw, fx: float, fy: float, rx: float, ry: float,
             fill: Fill | None, outline: Fill | None = None, width: int = 0) -> None:
        x, y = self._px(fx, fy)
        d.ellipse([x - rx * self._s2, y - ry * self._s2, x + rx * self._s2, y + ry * self._s2],
                  fill=fill, outline=outline, width=width)

    def _draw_background(self) -> Image.Image:
        i, n = self.identity, self.size
        yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) / (n - 1)
        if i.bg_kind == 0:
            w = yy
        elif i.bg_kind == 1:
            w = xx
        elif i.bg_kind == 2:
            w = np.clip(np.hypot(xx - 0.5, yy - 0.4) * 1.6, 0, 1)
        elif i.bg_kind == 3:
            w = 0.5 + 0.5 * np.sin(2 * np.pi * (xx * 0.7 + yy * 0.3) * 6)
        else:
            w = 0.5 + 0.25 * (np.sin(2 * np.pi * xx * 4) * np.sin(2 * np.pi * yy * 4) + 1) - 0.25
        img = (np.asarray(i.bg_a, np.float32) * (1 - w[..., None]) + np.asarray(i.bg_b, np.float32) * w[..., None])
        big = Image.fromarray(img.clip(0, 255).astype(np.uint8)).resize((self._s2, self._s2), Image.Resampling.NEAREST)
        d = ImageDraw.Draw(big)
        skin_dark = _rgb(np.asarray(i.skin) * 0.85)
        # neck and shoulders are part of the static background: only the head moves
        nx, ny = self._px(0, i.face_ry * 0.6)
        nw = i.face_rx * 0.45 * self._s2
        d.rectangle([nx - nw, ny, nx + nw, self._s2], fill=skin_dark)
        sx, sy = self._px(0, i.face_ry + 0.13)
        d.ellipse([sx - 0.36 * self._s2, sy, sx + 0.36 * self._s2, sy + 0.5 * self._s2], fill=i.shirt)
        d.ellipse([nx - nw, sy - 0.02 * self._s2, nx + nw, sy + 0.04 * self._s2], fill=skin_dark)
        return big.reduce(SS).convert("RGBA")

    def _draw_head(self, paint: Callable[[str, tuple[int, ...]], Fill] = _colour) -> Image.Image:
        """The head at 2x: RGBA in colour, or an ``L`` image of region indices when ``paint`` is
        :func:`_label` (the same shapes in the same order, so labels and pixels agree)."""
        i = self.identity
        img = Image.new("RGBA" if paint is _colour else "L", (self._s2, self._s2), 0 if paint is _label else (0, 0, 0, 0))
        d = ImageDraw.Draw(img)
        hair = paint("hair", (*i.hair, 255))
        skin = paint("skin", (*i.skin, 255))
        if i.hair_style == 2:  # long hair behind the head
            self._ell(d, 0, -i.face_ry * 0.12, i.face_rx * 1.3, i.face_ry * 1.05, hair)
        if i.hair_style == 3:  # bun
            self._ell(d, 0, -i.face_ry * 1.1, i.face_rx * 0.45, i.face_rx * 0.4, hair)
        ear = paint("skin", (*_rgb(np.asarray(i.skin) * 0.9), 255))
        for s in (-1, 1):
            self._ell(d, s * i.face_rx * 0.98, -0.01, i.face_rx * 0.16, i.face_ry * 0.2, ear)
        # face: an upper ellipse plus a lower one narrowed by the jaw parameter
        self._ell(d, 0, -i.face_ry * 0.1, i.face_rx, i.face_ry * 0.9, skin)
        self._ell(d, 0, i.face_ry * 0.15, i.face_rx * (0.92 - 0.22 * i.jaw), i.face_ry * 0.85, skin)
        if i.hair_style in (1, 2, 3, 4):  # hair cap on top of the head
            x, y = self._px(0, -i.face_ry * 0.45)
            rx, ry = i.face_rx * 1.06 * self._s2, i.face_ry * 0.62 * self._s2
            d.chord([x - rx, y - ry, x + rx, y + ry], 180, 360, fill=hair)
        if i.hair_style == 4:  # fringe
            self._ell(d, -i.face_rx * 0.3, -i.face_ry * 0.55, i.face_rx * 0.6, i.face_ry * 0.18, hair)
        # brows
        brow = paint("brows", (*_rgb(np.asarray(i.hair) * 0.8), 255))
        for s in (-1, 1):
            x0, y0 = self._px(s * (i.eye_dx - i.eye_rx), i.eye_y - i.eye_ry * 2.4 + i.brow_tilt)
            x1, y1 = self._px(s * (i.eye_dx + i.eye_rx * 1.1), i.eye_y - i.eye_ry * 2.4 - i.brow_tilt)
            d.line([x0, y0, x1, y1], fill=brow, width=max(2, int(i.brow_thick * self._s2)))
        # nose
        nose = paint("nose", (*_rgb(np.asarray(i.skin) * 0.72), 255))
        top = self._px(0, i.eye_y + 0.01)
        tip = self._px(0.012, i.mouth_y * 0.55)
        if i.nose_style == 0:
            d.line([*top, *tip, *self._px(-0.012, i.mouth_y * 0.58)], fill=nose, width=3)
        else:
            w = 0.014 if i.nose_style == 1 else 0.022
            for s in (-1, 1):
                self._ell(d, s * w, i.mouth_y * 0.58, 0.007, 0.005, nose)
        if i.hat is not None:
            hat = paint("hat", (*i.hat, 255))
            x, y = self._px(0, -i.face_ry * 0.62)
            rx = i.face_rx * 1.45 * self._s2
            d.ellipse([x - rx, y - 0.025 * self._s2, x + rx, y + 0.025 * self._s2], fill=hat)
            cx, cy = self._px(0, -i.face_ry * 0.75)
            crx, cry = i.face_rx * 0.95 * self._s2, i.face_ry * 0.55 * self._s2
            d.chord([cx - crx, cy - cry, cx + crx, cy + cry], 180, 360, fill=hat)
        if i.earrings is not None:
            for s in (-1, 1):
                self._ell(d, s * i.face_rx * 1.0, i.face_ry * 0.17, 0.012, 0.012, paint("earrings", (*i.earrings, 255)))
        return img

    def _draw_overlay(self, paint: Callable[[str, tuple[int, ...]], Fill] = _colour) -> Image.Image | None:
        i = self.identity
        if not i.glasses:
            return None
        img = Image.new("RGBA" if paint is _colour else "L", (self._s2, self._s2), 0 if paint is _label else (0, 0, 0, 0))
        d = ImageDraw.Draw(img)
        col = paint("glasses", (*i.glasses_color, 255))
        w = max(2, int(0.008 * self._s2))
        for s in (-1, 1):
            x, y = self._px(s * i.eye_dx, i.eye_y)
            rx, ry = (i.eye_rx + 0.02) * self._s2, (i.eye_ry + 0.025) * self._s2
            if i.glasses == 1:
                d.ellipse([x - rx, y - ry, x + rx, y + ry], outline=col, width=w)
            else:
                d.rectangle([x - rx, y - ry, x + rx, y + ry], outline=col, width=w)
        xl, y = self._px(-i.eye_dx + i.eye_rx + 0.02, i.eye_y)
        xr, _ = self._px(i.eye_dx - i.eye_rx - 0.02, i.eye_y)
        d.line([xl, y, xr, y], fill=col, width=w)
        return img

    # ---- per frame ------------------------------------------------------------------------------
    def _draw_features(self, d: ImageDraw.ImageDraw, mouth_open: float, mouth_width: float, blink: float,
                       paint: Callable[[str, tuple[int, ...]], Fill] = _colour) -> None:
        i = self.identity
        white = paint("eyes", (245, 245, 240, 255))
        open_eye = max(0.0, 1.0 - blink)
        for s in (-1, 1):
            if open_eye > 0.08:
                self._ell(d, s * i.eye_dx, i.eye_y, i.eye_rx, i.eye_ry * open_eye, white)
                ir = min(i.eye_ry * 0.95, i.eye_rx * 0.55)
                self._ell(d, s * i.eye_dx, i.eye_y, ir, min(ir, i.eye_ry * open_eye * 0.95),
                          paint("eyes", (*i.eye_color, 255)))
                self._ell(d, s * i.eye_dx, i.eye_y, ir * 0.45, min(ir * 0.45, i.eye_ry * open_eye * 0.5),
                          paint("eyes", (10, 10, 12, 255)))
            else:
                x0, y = self._px(s * i.eye_dx - i.eye_rx, i.eye_y)
                x1, _ = self._px(s * i.eye_dx + i.eye_rx, i.eye_y)
                d.line([x0, y, x1, y], fill=paint("eyes", (*_rgb(np.asarray(i.skin) * 0.55), 255)), width=3)
        # mouth: lips, dark interior, upper teeth as a chord covering the top 30 % of the interior
        o = float(np.clip(mouth_open, 0.0, 1.0))
        w = i.mouth_w * (0.85 + 0.3 * float(np.clip(mouth_width, 0.0, 1.0))) * (1 - 0.15 * o)
        h = self.MAX_OPEN * o
        self._ell(d, 0, i.mouth_y, w * 1.12, h / 2 + 0.012, paint("lips", (*i.lips, 255)))
        if h * self._s2 >= 1.0:
            x, y = self._px(0, i.mouth_y)
            rx, ry = w * self._s2, h / 2 * self._s2
            box = [x - rx, y - ry, x + rx, y + ry]
            d.ellipse(box, fill=paint("mouth", (*self._interior, 255)))
            a = math.degrees(math.asin(0.4))
            d.chord(box, 180 + a, 360 - a, fill=paint("mouth", (238, 234, 222, 255)))
        else:
            x0, y = self._px(-w, i.mouth_y)
            x1, _ = self._px(w, i.mouth_y)
            d.line([x0, y, x1, y], fill=paint("lips", (*_rgb(np.asarray(i.lips) * 0.75), 255)), width=2)

    def _affine(self, pose: HeadPose, out_x: int, out_y: int, in_x: float, in_y: float
                ) -> tuple[float, float, float, float, float, float]:
        """Inverse map for Image.transform from an output crop at (out_x, out_y) to the head crop at
        (in_x, in_y): p_in = R^T (p_out - c - t) / s + c, in full-frame pixels, then shifted."""
        cx, cy = self._center
        a = math.radians(pose.angle_deg)
        ca, sa = math.cos(a) / pose.scale, math.sin(a) / pose.scale
        tx, ty = cx + pose.dx - out_x, cy + pose.dy - out_y
        # R^T = [[c, s], [-s, c]]
        return (ca, sa, cx - ca * tx - sa * ty - in_x, -sa, ca, cy + sa * tx - ca * ty - in_y)

    def reference_shift(self, pose: HeadPose, cell: int = 1) -> np.ndarray:
        """Where the head drawn at ``pose`` came from in the reference (drawn at ``HeadPose()``): for
        the centre of each ``cell`` x ``cell`` block of the frame, the point :meth:`_affine`'s map (the
        head's placement, inverted) sends it to, minus the centre: ``(2, size/cell, size/cell)`` float32,
        (dy, dx) in pixels. The head's rigid motion, computed for every cell: it means something where
        the frame shows the head (the background does not move, and the eyes and mouth change shape
        besides). Who reads it: ``AvatarRenderer.head_motion`` (the decoder's motion loss, ``bench.warp_error``)."""
        if cell < 1 or self.size % cell:
            raise ValueError(f"cell={cell}: must divide the frame size {self.size}")
        a, b, c, d, e, f = self._affine(pose, 0, 0, 0.0, 0.0)  # full-frame pixels to full-frame pixels
        centres = (np.arange(self.size // cell, dtype=np.float64) + 0.5) * cell
        x, y = centres[None, :], centres[:, None]
        return np.stack([d * x + e * y + f - y, a * x + b * y + c - x]).astype(np.float32)

    def _forward(self, pose: HeadPose, x: float, y: float) -> tuple[float, float]:
        cx, cy = self._center
        a = math.radians(pose.angle_deg)
        u, v = (x - cx) * pose.scale, (y - cy) * pose.scale
        return (cx + pose.dx + u * math.cos(a) - v * math.sin(a), cy + pose.dy + u * math.sin(a) + v * math.cos(a))

    def _box(self, pose: HeadPose, fx0: float, fy0: float, fx1: float, fy1: float) -> Box:
        i, n = self.identity, self.size
        pts = [self._forward(pose, (i.face_cx + fx) * n, (i.face_cy + fy) * n)
               for fx in (fx0, fx1) for fy in (fy0, fy1)]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        return (max(0, int(math.floor(min(xs)))), max(0, int(math.floor(min(ys)))),
                min(n, int(math.ceil(max(xs))) + 1), min(n, int(math.ceil(max(ys))) + 1))

    def mouth_box(self, pose: HeadPose = HeadPose()) -> Box:
        """A box holding the mouth at any opening and width (plus lips), in output pixels."""
        i = self.identity
        w = i.mouth_w * 1.15 * 1.12 + 0.01
        h = self.MAX_OPEN / 2 + 0.02
        return self._box(pose, -w, i.mouth_y - h, w, i.mouth_y + h)

    def eyes_box(self, pose: HeadPose = HeadPose()) -> Box:
        """Both eyes with brows and glasses frames: what blinks, so drift metrics leave it out."""
        i = self.identity
        half = i.eye_dx + i.eye_rx + 0.03
        return self._box(pose, -half, i.eye_y - i.eye_ry * 2.4 - 0.02, half, i.eye_y + i.eye_ry + 0.03)

    def face_box(self, pose: HeadPose = HeadPose()) -> Box:
        i = self.identity
        return self._box(pose, -i.face_rx, -i.face_ry, i.face_rx, i.face_ry * 1.0)

    def render(self, pose: HeadPose = HeadPose(), mouth_open: float = 0.0, mouth_width: float = 0.5,
               blink: float = 0.0) -> np.ndarray:
        """One frame, ``size x size x 3`` uint8 (a new array the caller owns)."""
        feat = self._feat_base.copy()
        self._ox, self._oy = float(self._feat[0]), float(self._feat[1])
        try:
            self._draw_features(ImageDraw.Draw(feat), mouth_open, mouth_width, blink)
        finally:
            self._ox = self._oy = 0.0
        if self._feat_overlay is not None:
            feat.alpha_composite(self._feat_overlay)
        head = self._head1x.copy()
        head.paste(feat.reduce(SS), ((self._feat[0] - self._hbox[0]) // SS, (self._feat[1] - self._hbox[1]) // SS))
        (ox0, oy0, ox1, oy1), affine = self._placement(pose)
        placed = head.transform((ox1 - ox0, oy1 - oy0), Image.Transform.AFFINE, affine,
                                resample=Image.Resampling.BILINEAR)
        out = self._background.copy()
        out.alpha_composite(placed, dest=(ox0, oy0))
        return np.asarray(out.convert("RGB"))

    def _placement(self, pose: HeadPose) -> tuple[Box, tuple[float, float, float, float, float, float]]:
        """The output crop the posed head lands in (its box moved by the pose, plus a margin for
        rotation) and the affine map from that crop to the 1x head crop."""
        hx0, hy0, hx1, hy1 = (v / SS for v in self._hbox)
        pts = [self._forward(pose, x, y) for x in (hx0, hx1) for y in (hy0, hy1)]
        ox0 = max(0, int(min(p[0] for p in pts)) - 1)
        oy0 = max(0, int(min(p[1] for p in pts)) - 1)
        ox1 = min(self.size, int(max(p[0] for p in pts)) + 2)
        oy1 = min(self.size, int(max(p[1] for p in pts)) + 2)
        return (ox0, oy0, ox1, oy1), self._affine(pose, ox0, oy0, hx0, hy0)

    def region_masks(self, pose: HeadPose = HeadPose(), mouth_open: float = 0.0, mouth_width: float = 0.5,
                     blink: float = 0.0, names: tuple[str, ...] = REGIONS) -> dict[str, np.ndarray]:
        """Where each region of :data:`REGIONS` is visible in the frame :meth:`render` draws with the
        same arguments: ``{name: (size, size) float32 coverage in [0, 1]}`` (occlusion included: a
        pixel belongs to the shape drawn last). Who calls it: ``bench.fidelity`` (region distances,
        accessory presence) and tests; a few ms, so training loops do not.

        How: the same shapes in the same order are painted with region indices instead of colours
        (:func:`_label`) at 2x, box-reduced to 1x (the coverage the colour reduce averages over) and
        placed with the same bilinear affine warp; ``background`` is what the head does not cover.
        ``names`` limits the work to some regions (``background`` needs them all)."""
        unknown = set(names) - set(REGIONS)
        if unknown:
            raise ValueError(f"names={sorted(unknown)}: not regions; the regions are {REGIONS}")
        if "background" in names:
            names = REGIONS
        if self._label_layers is None:
            self._label_layers = (self._draw_head(_label), self._draw_overlay(_label))
        head2x, overlay2x = self._label_layers
        feat = head2x.crop(self._feat)
        self._ox, self._oy = float(self._feat[0]), float(self._feat[1])
        try:
            self._draw_features(ImageDraw.Draw(feat), mouth_open, mouth_width, blink, _label)
        finally:
            self._ox = self._oy = 0.0
        lab = head2x.crop(self._hbox)
        lab.paste(feat, (self._feat[0] - self._hbox[0], self._feat[1] - self._hbox[1]))
        labels = np.asarray(lab)
        if overlay2x is not None:
            over = np.asarray(overlay2x.crop(self._hbox))
            labels = np.where(over > 0, over, labels)
        (ox0, oy0, ox1, oy1), affine = self._placement(pose)
        h2, w2 = labels.shape
        out: dict[str, np.ndarray] = {}
        head = np.zeros((self.size, self.size), np.float32)
        for k, name in enumerate(REGIONS[1:], start=1):
            if name not in names:
                continue
            hit = labels == k
            if not hit.any():
                out[name] = np.zeros((self.size, self.size), np.float32)
                continue
            cov = hit.astype(np.float32).reshape(h2 // SS, SS, w2 // SS, SS).mean(axis=(1, 3))
            placed = Image.fromarray(cov, mode="F").transform((ox1 - ox0, oy1 - oy0), Image.Transform.AFFINE, affine,
                                                               resample=Image.Resampling.BILINEAR)
            full = np.zeros((self.size, self.size), np.float32)
            full[oy0:oy1, ox0:ox1] = np.asarray(placed)
            out[name] = full
            head += full
        out["background"] = np.clip(1.0 - head, 0.0, 1.0)
        return {name: out[name] for name in names}


def _enclosed_darkness(dark_HW: np.ndarray) -> np.ndarray:
    """``dark_HW`` with every dark (> 0) region that touches the array's edge set to 0: a flood fill
    from the edge through 4-connected dark pixels (a crop of tens of pixels: a few dozen steps)."""
    on = dark_HW > 0
    reach = np.zeros_like(on)
    reach[0], reach[-1], reach[:, 0], reach[:, -1] = on[0], on[-1], on[:, 0], on[:, -1]
    while True:
        grown = reach.copy()
        grown[1:] |= reach[:-1]
        grown[:-1] |= reach[1:]
        grown[:, 1:] |= reach[:, :-1]
        grown[:, :-1] |= reach[:, 1:]
        grown &= on
        if np.array_equal(grown, reach):
            return np.where(reach, 0.0, dark_HW)
        reach = grown


def measure_mouth_opening(frames_THW3: np.ndarray, mouth_box: np.ndarray | Box) -> np.ndarray:
    """Mouth opening per frame measured from PIXELS (never from ground truth), in units of the
    renderer's full opening (about 0 closed .. 1 wide open), float32 of length T.

    Who calls it: ``bench.quality`` (lip sync of model outputs and of ground-truth renders) and training
    scripts that want a pixel-level lip-sync check. ``mouth_box`` is one ``(x0, y0, x1, y1)`` box for
    all frames or a ``(T, 4)`` array, in pixels of the frames.

    How: inside the box, a pixel's darkness ramps from 0 at half the box's median luminance to 1 at
    0.3x the median (the mouth interior is drawn at ~0.16x the skin), so a global colour or brightness
    shift of the frame does not change the answer. Dark pixels connected to the box's edge are not
    counted (:func:`_enclosed_darkness`): the interior is enclosed by the lips, and what reaches the
    edge is something else the head's motion brought in (held-out face 29's dark bob at both sides
    of a fixed box counted as a wide-open mouth in closed-mouth frames: its ground truth scored lip
    sync r 0.28 through the reference's box, 0.99 through its own). The opening is the mean of the
    three largest per-column sums of darkness (the vertical extent of the dark interior, which the
    renderer makes proportional to the opening: teeth cover a fixed 30 % of it, and mouth width does
    not matter).
    """
    frames = np.asarray(frames_THW3)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames_THW3 has shape {frames.shape}: expected (T, H, W, 3)")
    t_len, h, w = frames.shape[:3]
    boxes = np.asarray(mouth_box, dtype=np.int64)
    if boxes.ndim == 1:
        boxes = np.broadcast_to(boxes, (t_len, 4))
    if boxes.shape != (t_len, 4):
        raise ValueError(f"mouth_box has shape {boxes.shape}: expected (4,) or ({t_len}, 4)")
    full = FaceRenderer.MAX_OPEN * h * 0.7  # dark extent at opening 1, in pixels
    out = np.zeros(t_len, dtype=np.float32)
    for t in range(t_len):
        x0, y0, x1, y1 = (int(v) for v in boxes[t])
        x0, y0, x1, y1 = max(0, x0), max(0, y0), min(w, x1), min(h, y1)
        if x1 - x0 < 3 or y1 - y0 < 2:
            continue
        crop = frames[t, y0:y1, x0:x1].astype(np.float32)
        lum = crop[..., 0] * 0.299 + crop[..., 1] * 0.587 + crop[..., 2] * 0.114
        med = max(float(np.median(lum)), 8.0)
        dark = _enclosed_darkness(np.clip((0.5 * med - lum) / (0.2 * med), 0.0, 1.0))
        cols = np.sort(dark.sum(axis=0))[-3:]
        out[t] = float(cols.mean()) / full
    return out
