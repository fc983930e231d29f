"""Synthetic talking avatars: procedural faces (``face``), speech and the audio->mouth mapping
(``speech``), and clips for training and evaluation (``dataset``). See docs/quality.md."""
