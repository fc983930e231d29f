"""KVS live preview through our PutMedia client against the local wire-protocol stand-in."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.integration.delivery_media import make_sample
from tests.integration.kvs_standin import ACCESS_KEY, REGION, SECRET_KEY, KVSStandIn
from tests.integration.s3_fixtures import (
    MotoServer,
    moto_s3,  # noqa: F401
)
from worker.delivery.keys import job_prefix
from worker.delivery.kvs.putmedia import PutMediaClient
from worker.delivery.kvs.sink import KVSPreviewSink
from worker.delivery.s3_sink import S3ProgressiveSink
from worker.delivery.segment import SegmentRecord

pytestmark = pytest.mark.integration

STREAM = "longtake-preview-test"


@pytest.fixture
def standin() -> Iterator[KVSStandIn]:
    server = KVSStandIn(streams={STREAM})
    try:
        yield server
    finally:
        server.stop()


def make_sink(standin: KVSStandIn, *, secret: str = SECRET_KEY) -> KVSPreviewSink:
    client = PutMediaClient(STREAM, region=REGION, endpoint_url=standin.url, access_key_id=ACCESS_KEY,
                            secret_access_key=secret)
    return KVSPreviewSink(client, ack_timeout_s=20)


def render_to(sinks: list, pace_s: float = 0.05) -> None:  # type: ignore[type-arg]
    sample = make_sample(6.0)
    for s in sinks:
        s.open(sample.init)
    for frag in sample.fragments:
        for s in sinks:
            s.write(frag)
        time.sleep(pace_s)
    for s in sinks:
        s.close(ok=True)


def test_every_fragment_acked_in_order(standin: KVSStandIn) -> None:
    sample = make_sample(6.0)
    sink = make_sink(standin)
    render_to([sink])
    assert sink.status == "done", sink.error
    assert sink.acked == list(range(len(sample.fragments)))
    st = standin.state
    assert st.rejected == [] and st.sessions == 1
    assert [p.video_frames for p in st.persisted] == [f.num_frames for f in sample.fragments]
    assert all(p.audio_frames > 0 for p in st.persisted)
    tcs = [p.timecode for p in st.persisted]
    assert tcs == sorted(set(tcs))
    kinds = [e.event_type for e in sink.events]
    assert kinds.count("PERSISTED") == len(sample.fragments) and kinds.count("BUFFERING") == len(sample.fragments)


def test_retriable_error_is_retried(standin: KVSStandIn) -> None:
    standin.state.inject = {3: 5000}  # INTERNAL_ERROR on the 4th cluster: KVS ends the session
    sample = make_sample(6.0)
    sink = make_sink(standin)
    render_to([sink])
    assert sink.status == "done", sink.error
    assert sink.acked == list(range(len(sample.fragments)))
    st = standin.state
    assert len(st.errors_sent) == 1 and st.errors_sent[0][1] == 5000
    assert st.sessions == 2
    assert len(st.persisted) == len(sample.fragments)  # the errored fragment resent once, no duplicates
    assert [p.video_frames for p in st.persisted] == [f.num_frames for f in sample.fragments]


def test_fatal_error_stops_preview_not_render(standin: KVSStandIn, moto_s3: MotoServer) -> None:  # noqa: F811
    standin.state.inject = {2: 4500}  # KMS_KEY_ACCESS_DENIED: nothing a retry can fix
    sample = make_sample(6.0)
    kvs = make_sink(standin)
    store = moto_s3.store()
    commits: list[SegmentRecord] = []
    s3 = S3ProgressiveSink(store, job_prefix("acme", "kvs-fatal"), on_commit=commits.append)
    render_to([kvs, s3])
    assert kvs.status == "stopped" and "4500" in (kvs.error or "")
    assert kvs.acked == [0, 1]
    assert standin.state.sessions == 1  # not retried
    assert store.get_bytes(s3.final_key) == sample.mp4
    assert len(commits) == len(sample.fragments)


def test_bad_credentials_stop_preview_only(standin: KVSStandIn) -> None:
    sink = make_sink(standin, secret="wrong-secret")
    t0 = time.monotonic()
    render_to([sink])
    assert time.monotonic() - t0 < 30
    assert sink.status == "stopped"
    assert standin.state.rejected and "signature" in standin.state.rejected[0]
    assert standin.state.persisted == []


def test_hls_session_url(standin: KVSStandIn) -> None:
    client = PutMediaClient(STREAM, region=REGION, endpoint_url=standin.url, access_key_id=ACCESS_KEY,
                            secret_access_key=SECRET_KEY)
    url = client.hls_session_url(expires_s=600)
    assert url.startswith(standin.url + "/hls/v1/getHLSMasterPlaylist.m3u8?SessionToken=")
    assert standin.state.rejected == []


def test_retries_are_bounded(standin: KVSStandIn) -> None:
    # fragment 3 fails on every session: after max_retries new sessions the preview gives up
    standin.state.inject = {n: 5000 for n in range(3, 12)}
    sink = make_sink(standin)
    render_to([sink])
    assert sink.status == "stopped" and "failed 4 times" in (sink.error or "")
    assert sink.acked == [0, 1, 2]
    assert standin.state.sessions == 4  # the first session + max_retries (3) reconnects
