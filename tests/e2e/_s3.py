"""A real S3-compatible server on 127.0.0.1 for the remote-checkpoint tests: moto's server mode
(a dev dependency), with one bucket and dummy credentials; no traffic leaves this machine."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from dataclasses import dataclass
from typing import Any

from _helpers import clean_env, pimm_here

BUCKET = "pimm-test"


@dataclass
class S3:
    server: Any  # moto.server.ThreadedMotoServer
    endpoint: str  # http://127.0.0.1:<port>
    fs: Any  # s3fs.S3FileSystem talking to it

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/exp"

    def env(self) -> dict[str, str]:
        """clean_env() plus the dummy credentials and the endpoint every boto client reads."""
        return {**clean_env(), **aws_env(self.endpoint)}

    def ls(self, path: str) -> list[str]:
        self.fs.invalidate_cache()
        return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(f"{BUCKET}/{path}", detail=False)) \
            if self.fs.exists(f"{BUCKET}/{path}") else []


def aws_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_MAX_ATTEMPTS": "2", "NO_PROXY": "127.0.0.1",
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}


def start_s3() -> S3:
    """Start moto's S3 server on a free port of 127.0.0.1 and create the test bucket."""
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    # moto's state lives in this process: an earlier test's bucket is removed
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30).close()
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint},
                           skip_instance_cache=True)
    fs.mkdir(BUCKET)
    return S3(server, endpoint, fs)


def pimm_here_s3(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """:func:`_helpers.pimm_here` with ``env`` as the whole environment for the call, as a fresh process sees it:
    fsspec's cached filesystems (whose endpoint, credentials and listings were read earlier) are dropped
    before and after, and the temporary directory follows ``env["TMPDIR"]``."""
    import tempfile

    from s3fs import S3FileSystem

    saved, saved_tmp = dict(os.environ), tempfile.tempdir
    S3FileSystem.clear_instance_cache()  # (each fsspec class keeps its own instance cache)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = env.get("TMPDIR")
    try:
        return pimm_here(*args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        tempfile.tempdir = saved_tmp
        S3FileSystem.clear_instance_cache()
