"""Training of the ``tiny`` model family on synthetic avatars (see docs/training.md).

``python -m models.training.train_all --minutes-budget 75`` runs everything: VAE, latent cache, A2V
(+ audio encoder), SR, then writes ``models/checkpoints/tiny.safetensors``.
"""
