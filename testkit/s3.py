"""A real S3-compatible server on 127.0.0.1 for tests: moto's standalone server, in a thread of this process.

``with s3_server() as env:`` starts it on a free port with one bucket and yields the environment
variables that point boto3/s3fs at it (endpoint, dummy credentials, region); processes started with them
(torchrun workers) reach the same server. Needs the ``s3`` extra (``moto[server]``, ``s3fs``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from testkit.distributed import free_port

__all__ = ["s3_server"]


@contextmanager
def s3_server(bucket: str = "checkpoints") -> Iterator[dict[str, str]]:
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }
    try:
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )
        client.create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()
