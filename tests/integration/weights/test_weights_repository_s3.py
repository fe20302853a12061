"""The model repository on S3 (moto_server): the same suite as on a local directory."""

from __future__ import annotations

import pytest

from coldstart.remote.s3 import split_s3_url
from coldstart.weights import ModelRepository
from tests.fixtures.s3 import s3_client
from tests.unit.weights.repo_suite import RepositorySuite

pytestmark = pytest.mark.integration


class TestS3Repository(RepositorySuite):
    @pytest.fixture
    def repo(self, s3: str, monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> ModelRepository:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
        bucket = "repo-" + request.node.name.lower().replace("_", "-")[:50]
        s3_client(s3).create_bucket(Bucket=bucket)
        return ModelRepository(f"s3://{bucket}/models/prod")

    def corrupt(self, repo: ModelRepository, key: str, data: bytes) -> None:
        bucket, prefix = split_s3_url(repo.store.root)
        import os

        s3_client(os.environ["AWS_ENDPOINT_URL"]).put_object(
            Bucket=bucket, Key=f"{prefix}/{key}", Body=data)


def test_listing_a_missing_bucket_is_not_found(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from coldstart.errors import NotFound

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    with pytest.raises(NotFound):
        ModelRepository("s3://no-such-bucket-here/models").list_versions()
    s3_client(s3).create_bucket(Bucket="repo-empty-prefix")
    assert ModelRepository("s3://repo-empty-prefix/models").list_versions() == []
