"""Delivery: object storage, the progressive S3 sink and the KVS live preview. See docs/delivery.md."""
