"""A tiny stand-in for the Hugging Face Hub on 127.0.0.1, for offline tests of the hub path.

It serves one folder as a model repository, speaking the part of the hub's protocol that
`huggingface_hub.snapshot_download` uses (huggingface_hub 2.x):

    GET  /api/models/{repo}/revision/{rev}               repo info: commit sha and file list
    GET  /api/models/{repo}/tree/{sha}?recursive=true    file list with sizes and LFS sha256
    HEAD /{repo}/resolve/{sha}/{file}                    X-Repo-Commit, ETag (LFS: X-Linked-Etag = sha256)
    GET  /{repo}/resolve/{sha}/{file}                    the bytes

Point `HF_ENDPOINT` at `FakeHub.url`, the same variable a user sets for a mirror.
`corrupt=True` serves weight files with one flipped bit while advertising the true sha256,
which is what a damaged mirror or a broken transfer looks like to the client.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


class FakeHub:
    def __init__(self, repo_id: str, folder: Path, corrupt: bool = False):
        self.repo_id, self.folder, self.corrupt = repo_id, Path(folder), corrupt
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                hub.requests.append(f"{self.command} {self.path}")
                code, body, headers = hub.respond(self.command, self.path.split("?")[0])
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*") if p.is_file())

    def entry(self, path: Path) -> dict:
        data = path.read_bytes()
        entry = {"type": "file", "path": path.relative_to(self.folder).as_posix(), "size": len(data),
                 "oid": hashlib.sha1(data).hexdigest()}
        if path.suffix in LFS_SUFFIXES:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def respond(self, method: str, path: str) -> tuple[int, bytes, dict]:
        as_json = {"Content-Type": "application/json"}
        api = f"/api/models/{self.repo_id}/"
        if path.startswith(api + "revision/"):
            info = {"id": self.repo_id, "sha": COMMIT,
                    "siblings": [{"rfilename": e["path"]} for e in map(self.entry, self.files())]}
            return 200, json.dumps(info).encode(), as_json
        if path.startswith(api + "tree/"):
            return 200, json.dumps([self.entry(p) for p in self.files()]).encode(), as_json
        prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix):].split("/", 1)[1]
            file = self.folder / name
            if not file.is_file() or ".." in name:
                return 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}
            entry, data = self.entry(file), file.read_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{entry["oid"]}"'}
            if "lfs" in entry:
                headers |= {"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(len(data))}
                if self.corrupt:
                    data = data[:-1] + bytes([data[-1] ^ 1])
            return 200, data, headers
        return 404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}
