"""A loopback HTTP server for image URLs in tests: ``with serve_files({"/a.png": data}) as base: ...`` serves the
bytes on ``http://127.0.0.1:<port>/a.png`` (any other path: 404) and nothing else; standard library only."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def serve_files(files: Mapping[str, bytes]) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of a server answering ``GET path`` with ``files[path]``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- the name http.server calls
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            body = b"not found" if body is None else body
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
