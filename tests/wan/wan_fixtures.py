"""Helpers that write tiny Wan releases in the public layouts, on random weights (no download): they
live in ``models.wan.tiny_release`` (the benchmarks and the family's tests use them too); re-exported
here for the model tests."""

from __future__ import annotations

from models.wan.tiny_release import is_audio_key, random_dit_state, wan_config_json, write_sharded

__all__ = ["is_audio_key", "random_dit_state", "wan_config_json", "write_sharded"]
