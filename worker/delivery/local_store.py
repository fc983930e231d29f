"""The local-directory object store (the embedded default on a laptop), behind :class:`ObjectStore`.

Built by :func:`worker.delivery.storage.open_object_store` for ``file:///abs/dir``.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from worker.delivery.keys import check_relative_key
from worker.delivery.object_store import PartInfo
from worker.errors import ObjectNotFoundError, StorageError


class LocalObjectStore:
    """Objects as files under ``root`` (the embedded default on a laptop). Writes are atomic
    (temp file + rename), so a reader never sees half an object. Multipart uploads keep their parts
    under ``root/.multipart/<upload id>/`` until completed or aborted."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._mp_root = self.root / ".multipart"
        self.bytes_sent = 0
        self.num_requests = 0
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        path = (self.root / check_relative_key(key)).resolve()
        if not path.is_relative_to(self.root):  # defence in depth; the key check already forbids it
            raise ValueError(f"key={key!r} escapes the store root {self.root}")
        return path

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.num_requests += 1

    def _write_atomic(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def put_bytes(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        self._count(len(data))
        self._write_atomic(self._path(key), data)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(f"no object {key!r} under {self.root}", op="get", key=key) from exc

    def download_to(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFoundError(f"no object {key!r} under {self.root}", op="download", key=key)
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> builtins.list[str]:
        out = []
        for p in self.root.rglob("*"):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and not rel.startswith(".multipart/") and not p.name.startswith("."):
                if rel.startswith(prefix):
                    out.append(rel)
        return sorted(out)

    def presign_get(self, key: str, expires_s: int = 3600) -> str:
        return self._path(key).as_uri()

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def _upload_dir(self, key: str, upload_id: str, op: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id):
            raise ObjectNotFoundError(f"upload_id={upload_id!r} is not an upload of this store", op=op, key=key)
        d = self._mp_root / upload_id
        if not (d / "key").is_file() or (d / "key").read_text() != key:
            raise ObjectNotFoundError(f"no multipart upload {upload_id} for {key!r}", op=op, key=key)
        return d

    def create_multipart(self, key: str, *, content_type: str | None = None) -> str:
        self._path(key)
        upload_id = uuid.uuid4().hex
        d = self._mp_root / upload_id
        d.mkdir(parents=True)
        (d / "key").write_text(key)
        return upload_id

    def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str:
        if not 1 <= part_number <= 10000:
            raise ValueError(f"part_number={part_number} must be in 1..10000")
        d = self._upload_dir(key, upload_id, "upload_part")
        self._count(len(data))
        self._write_atomic(d / f"{part_number:05d}.part", data)
        return '"' + hashlib.md5(data).hexdigest() + '"'

    def list_parts(self, key: str, upload_id: str) -> builtins.list[PartInfo]:
        d = self._upload_dir(key, upload_id, "list_parts")
        out = []
        for p in sorted(d.glob("*.part")):
            data = p.read_bytes()
            out.append(PartInfo(int(p.stem), '"' + hashlib.md5(data).hexdigest() + '"', len(data)))
        return out

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        d = self._upload_dir(key, upload_id, "complete_multipart")
        have = {p.part_number: p.etag for p in self.list_parts(key, upload_id)}
        for n, etag in parts:
            if have.get(n) != etag:
                raise StorageError(
                    f"complete_multipart {key!r}: part {n} etag {etag} does not match the stored part "
                    f"({have.get(n)})", op="complete_multipart", key=key, retryable=False,
                )
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{upload_id}.tmp")
        with open(tmp, "wb") as out:
            for n, _ in parts:
                with open(d / f"{n:05d}.part", "rb") as src:
                    shutil.copyfileobj(src, out)
        os.replace(tmp, dest)
        shutil.rmtree(d)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        shutil.rmtree(self._upload_dir(key, upload_id, "abort_multipart"))
