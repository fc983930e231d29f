"""Speech for the synthetic avatars, and the one function that turns audio into a mouth opening.

Who calls what:

* :class:`SpeechSynth` — the dataset (``models.avatars.dataset``) and ``bench.quality --ground-truth``
  call :meth:`SpeechSynth.utterance` to get real speech from ``espeak-ng`` (several voices and
  languages, deterministic from a seed), resampled to 16 kHz float32 and loudness-normalised. When
  ``espeak-ng`` is not installed, :func:`speechlike_signal` gives a deterministic speech-like signal
  instead (syllable-rate bursts of a formant-filtered pulse train) so the dataset still works.
* :func:`mouth_opening_track` — THE audio -> mouth mapping. The generator draws its mouth with it and
  ``bench.quality`` scores lip sync against it, so ground-truth renders are in sync by construction
  and a model is scored against exactly what it was trained to reproduce. Never change it without
  retraining: checkpoints learn this function.

Nothing here keeps audio between calls except the small utterance cache of :class:`SpeechSynth`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
TARGET_RMS_DBFS = -20.0  # loudness of the voiced parts after normalize_loudness

# Voices the model trains on, and voices kept for evaluation only (different accents / languages).
TRAIN_VOICES: tuple[str, ...] = ("en-us", "en-gb", "es", "fr-fr", "de", "it", "pt-br", "nl", "id")
HELDOUT_VOICES: tuple[str, ...] = ("en-gb-scotland", "es-419", "fr-be", "sw", "pt")
# espeak-ng voice variants (male/female timbres), appended as "+variant"
VARIANTS: tuple[str, ...] = ("m1", "m3", "m5", "f1", "f2", "f4")

_WORDS: dict[str, tuple[str, ...]] = {
    "en": ("hello", "morning", "river", "window", "yellow", "table", "people", "little", "garden",
           "open", "music", "paper", "happy", "city", "summer", "water", "bright", "quiet", "number",
           "story", "always", "never", "today", "picture", "orange", "mountain", "simple", "travel"),
    "es": ("hola", "casa", "perro", "montaña", "verde", "agua", "ciudad", "mañana", "tiempo", "amigo",
           "cielo", "puerta", "camino", "noche", "fuego", "libro", "palabra", "música", "siempre"),
    "fr": ("bonjour", "maison", "rivière", "fenêtre", "soleil", "jardin", "musique", "toujours",
           "petit", "nuage", "chemin", "parler", "lumière", "montagne", "heureux", "ville", "demain"),
    "de": ("hallo", "morgen", "fenster", "garten", "wasser", "sonne", "strasse", "freund", "immer",
           "kleine", "musik", "zeitung", "berge", "abend", "schnell", "wolke", "lachen", "reise"),
    "it": ("ciao", "giorno", "finestra", "giardino", "acqua", "sole", "strada", "amico", "sempre",
           "piccolo", "musica", "montagna", "notte", "parola", "cielo", "felice", "viaggio"),
    "pt": ("olá", "casa", "janela", "jardim", "água", "sol", "caminho", "amigo", "sempre", "pequeno",
           "música", "montanha", "noite", "palavra", "céu", "feliz", "viagem", "cidade"),
    "nl": ("hallo", "morgen", "venster", "tuin", "water", "zon", "straat", "vriend", "altijd",
           "klein", "muziek", "berg", "avond", "snel", "wolk", "lachen", "reis", "boek"),
    "id": ("halo", "pagi", "jendela", "taman", "air", "matahari", "jalan", "teman", "selalu",
           "kecil", "musik", "gunung", "malam", "kata", "langit", "senang", "kota", "buku"),
    "sw": ("jambo", "asubuhi", "dirisha", "bustani", "maji", "jua", "barabara", "rafiki", "daima",
           "ndogo", "muziki", "mlima", "usiku", "neno", "anga", "furaha", "safari", "kitabu"),
}


def _lang_of(voice: str) -> str:
    base = voice.split("+")[0].split("-")[0]
    return base if base in _WORDS else "en"


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def resample(audio: np.ndarray, src_rate: int, dst_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited resampling (windowed-sinc low-pass, then linear interpolation); float32 out.

    Good enough for speech envelopes and mel features; no scipy on the target machines.
    """
    x = np.asarray(audio, dtype=np.float64)
    if src_rate == dst_rate or x.size == 0:
        return x.astype(np.float32)
    if dst_rate < src_rate:
        cutoff = 0.45 * dst_rate / src_rate  # cycles per source sample, below the new Nyquist
        n = np.arange(-32, 33)
        taps = 2 * cutoff * np.sinc(2 * cutoff * n) * np.hamming(n.size)
        x = np.convolve(x, taps / taps.sum(), mode="same")
    num_out = int(round(x.size * dst_rate / src_rate))
    t = np.arange(num_out) * (src_rate / dst_rate)
    return np.interp(t, np.arange(x.size), x).astype(np.float32)


def normalize_loudness(audio: np.ndarray, target_dbfs: float = TARGET_RMS_DBFS) -> np.ndarray:
    """Scale so the voiced parts (20 ms frames above -50 dB of the loudest) have RMS ``target_dbfs``.

    Called on every utterance the generator uses and on any audio ``bench.quality`` scores, so the
    mouth track does not depend on how loud a file was recorded.
    """
    x = np.asarray(audio, dtype=np.float32)
    hop = 320
    n = x.size // hop
    if n == 0:
        return x.copy()
    rms = np.sqrt(np.mean(x[: n * hop].reshape(n, hop).astype(np.float64) ** 2, axis=1))
    peak = float(rms.max())
    if peak <= 1e-8:
        return x.copy()
    voiced = rms[rms > peak * 10 ** (-50 / 20)]
    level = float(np.sqrt(np.mean(voiced**2)))
    gain = 10 ** (target_dbfs / 20) / level
    return np.clip(x * gain, -1.0, 1.0).astype(np.float32)


def parse_wav_bytes(data: bytes) -> tuple[np.ndarray, int]:
    """Decode the 16-bit PCM mono WAV that ``espeak-ng --stdout`` writes (its size fields are bogus
    when streaming, so chunks are walked and the data chunk runs to the end of the bytes)."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"espeak-ng output is not a WAV file (starts with {data[:12]!r})")
    pos, rate, bits, channels = 12, 0, 16, 1
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if cid == b"fmt ":
            channels = int.from_bytes(data[pos + 10 : pos + 12], "little")
            rate = int.from_bytes(data[pos + 12 : pos + 16], "little")
            bits = int.from_bytes(data[pos + 22 : pos + 24], "little")
        if cid == b"data":
            pcm = data[pos + 8 :]
            pcm = pcm[: len(pcm) - len(pcm) % (2 * channels)]
            if bits != 16:
                raise ValueError(f"WAV bits per sample {bits}: only 16-bit PCM is supported")
            x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
            return x.reshape(-1, channels).mean(axis=1), rate
        pos += 8 + size + (size & 1)
    raise ValueError("WAV has no data chunk")


def random_sentence(rng: np.random.Generator, voice: str, num_words: int) -> str:
    words = _WORDS[_lang_of(voice)]
    picked = [words[int(i)] for i in rng.integers(0, len(words), size=num_words)]
    # commas make espeak pause: pauses are where the mouth must close
    out: list[str] = []
    for i, w in enumerate(picked):
        out.append(w + ("," if i % 4 == 3 and i + 1 < len(picked) else ""))
    return " ".join(out) + "."


def speechlike_signal(seed: int, seconds: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Deterministic speech-like audio: 3-7 Hz syllable bursts of a glottal pulse train through two
    resonances, with pauses. Used when espeak-ng is missing; loudness-normalised, float32."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    f0 = rng.uniform(95, 230) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t))
    phase = np.cumsum(f0 / sample_rate)
    pulses = (phase % 1.0) ** 6  # sawtooth-like, rich in harmonics
    src = pulses - pulses.mean() + 0.05 * rng.standard_normal(n)
    out = np.zeros(n)
    for fc, bw in ((rng.uniform(400, 900), 120.0), (rng.uniform(1100, 2300), 200.0)):
        r = np.exp(-np.pi * bw / sample_rate)
        a1, a2 = 2 * r * np.cos(2 * np.pi * fc / sample_rate), -r * r
        y = np.zeros(n)
        # two-pole resonator, vectorised by blocks would be faster; this runs once per utterance
        y1 = y2 = 0.0
        for i in range(n):
            y0 = src[i] + a1 * y1 + a2 * y2
            y[i] = y0
            y2, y1 = y1, y0
        out += y
    env = np.zeros(n)
    pos = int(rng.uniform(0.05, 0.3) * sample_rate)
    while pos < n:
        dur = int(rng.uniform(0.12, 0.3) * sample_rate)
        seg = np.sin(np.linspace(0, np.pi, max(dur, 2))) ** 1.5 * rng.uniform(0.4, 1.0)
        end = min(n, pos + dur)
        env[pos:end] = np.maximum(env[pos:end], seg[: end - pos])
        pos += int(dur * rng.uniform(0.7, 1.1))
        if rng.random() < 0.12:
            pos += int(rng.uniform(0.2, 0.6) * sample_rate)  # a pause
    return normalize_loudness((out * env).astype(np.float32))


@dataclass(frozen=True)
class Utterance:
    audio: np.ndarray  # float32 mono, SAMPLE_RATE, loudness-normalised
    voice: str  # "fallback" when espeak-ng was not used
    text: str


class SpeechSynth:
    """Deterministic utterances from ``(seed, split)``; a small LRU cache avoids re-running espeak-ng.

    ``split`` is ``"train"`` (TRAIN_VOICES) or ``"heldout"`` (HELDOUT_VOICES). The voices need
    ``espeak-ng`` on PATH and a synth refuses without it; ``use_espeak=False`` asks for the speech-like
    fallback by name (tests of layout and determinism). There is no silent fallback: it once trained
    and scored models on the fallback where the voices were meant, and the two drive a mouth differently.
    """

    def __init__(self, use_espeak: bool = True, cache_size: int = 256) -> None:
        if use_espeak and not espeak_available():
            raise RuntimeError("the espeak-ng voices need espeak-ng, which is not on PATH: install it "
                               "(apt-get install espeak-ng; `make test` does), or pass use_espeak=False "
                               "for the speech-like signal, which is not the voices")
        self.use_espeak = use_espeak
        self._cache: OrderedDict[tuple[int, str, float], Utterance] = OrderedDict()
        self._cache_size = cache_size

    def utterance(self, seed: int, split: str = "train", min_seconds: float = 4.0) -> Utterance:
        key = (seed, split, min_seconds)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        utt = self._make(seed, split, min_seconds)
        self._cache[key] = utt
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return utt

    def _make(self, seed: int, split: str, min_seconds: float) -> Utterance:
        if split not in ("train", "heldout"):
            raise ValueError(f"split={split!r}: must be 'train' or 'heldout'")
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, 7])
        if not self.use_espeak:
            return Utterance(speechlike_signal(int(rng.integers(2**31)), min_seconds + 1.0), "fallback", "")
        voices = TRAIN_VOICES if split == "train" else HELDOUT_VOICES
        voice = voices[int(rng.integers(len(voices)))] + "+" + VARIANTS[int(rng.integers(len(VARIANTS)))]
        speed = int(rng.integers(130, 190))
        pitch = int(rng.integers(25, 75))
        num_words = max(4, int(min_seconds * 2.6))
        text = random_sentence(rng, voice, num_words)
        audio = self.speak(text, voice, speed, pitch)
        while audio.size < min_seconds * SAMPLE_RATE:  # slow voices: add another sentence
            text2 = random_sentence(rng, voice, num_words)
            audio = np.concatenate([audio, self.speak(text2, voice, speed, pitch)])
            text += " " + text2
        return Utterance(normalize_loudness(audio), voice, text)

    @staticmethod
    def speak(text: str, voice: str, speed: int = 160, pitch: int = 50) -> np.ndarray:
        """Run espeak-ng once; float32 mono at SAMPLE_RATE (not loudness-normalised)."""
        proc = subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", text],
            capture_output=True, check=False, timeout=60,
        )
        if proc.returncode != 0 or not proc.stdout:
            raise RuntimeError(f"espeak-ng -v {voice} failed (rc={proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace').strip()}")
        x, rate = parse_wav_bytes(proc.stdout)
        return resample(x, rate, SAMPLE_RATE)


def frame_rms_db(audio: np.ndarray, num_frames: int, fps: int = 25, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """RMS level (dBFS) of each video frame's audio window: frame ``t`` covers samples
    ``[t*hop - hop/2, (t+1)*hop + hop/2)`` with ``hop = sample_rate / fps`` (centred, 2 hops wide)."""
    hop = sample_rate // fps
    x = np.asarray(audio, dtype=np.float32)
    need = (num_frames + 1) * hop
    padded = np.zeros(need + hop, dtype=np.float64)
    m = min(x.size, need)
    padded[hop // 2 : hop // 2 + m] = x[:m]
    sq = padded**2
    csum = np.concatenate([[0.0], np.cumsum(sq)])
    starts = np.arange(num_frames) * hop
    energy = (csum[starts + 2 * hop] - csum[starts]) / (2 * hop)
    return 10 * np.log10(energy + 1e-10)


def mouth_opening_track(audio: np.ndarray, num_frames: int, fps: int = 25,
                        sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mouth opening in [0, 1] per video frame, a fixed function of the audio.

    Per-frame RMS in dB (centred window, :func:`frame_rms_db`), mapped linearly from -50 dBFS
    (closed) to -14 dBFS (wide open), clipped, then a symmetric [1, 2, 1] smoothing (symmetric so it
    adds no audio/video lag). Expects loudness-normalised audio (:func:`normalize_loudness`).
    """
    db = frame_rms_db(audio, num_frames, fps, sample_rate)
    raw = np.clip((db + 50.0) / 36.0, 0.0, 1.0)
    padded = np.concatenate([raw[:1], raw, raw[-1:]])
    return ((padded[:-2] + 2 * padded[1:-1] + padded[2:]) / 4).astype(np.float32)


def mouth_width_track(audio: np.ndarray, num_frames: int, fps: int = 25,
                      sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mouth shape in [0, 1] per frame (0 round "oo", 1 wide "ee"), from the zero-crossing rate:
    bright, high-frequency sounds spread the lips. Shape only; the opening carries lip sync."""
    hop = sample_rate // fps
    x = np.asarray(audio, dtype=np.float32)[: num_frames * hop]
    m = x.size // hop
    out = np.full(num_frames, 0.5, dtype=np.float32)
    if m == 0:
        return out
    seg = x[: m * hop].reshape(m, hop)
    zcr = np.mean(np.abs(np.diff(np.signbit(seg).astype(np.int8), axis=1)), axis=1)
    loud = np.abs(seg).max(axis=1) >= 1e-3  # silence keeps the neutral shape
    out[:m] = np.where(loud, np.clip((zcr - 0.03) / 0.17, 0.0, 1.0), 0.5)
    return out
