"""longtake's model-agnostic streaming framework: Module, Stage, Pipeline, schedule, encoding.

Nothing in this package knows of Celery, SQL or S3.
"""
