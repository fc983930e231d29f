"""Kinesis Video Streams live preview: fMP4 -> MKV remuxing and our own PutMedia client
(boto3 has no PutMedia). Used by :class:`worker.delivery.kvs.sink.KVSPreviewSink`."""
