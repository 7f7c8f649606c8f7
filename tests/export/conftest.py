"""Fixtures of the exporter tests: real OTLP receivers on 127.0.0.1, and no OTEL_* variable of the
machine running the tests."""

from __future__ import annotations

import os

import pytest

from tests.export.otlp import Target
from tests.receivers import OtlpGrpcReceiver, OtlpHttpReceiver


@pytest.fixture
def http_receiver():
    with OtlpHttpReceiver() as receiver:
        yield receiver


@pytest.fixture
def grpc_receiver():
    with OtlpGrpcReceiver() as receiver:
        yield receiver


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


@pytest.fixture(params=["http/protobuf", "grpc"])
def target(request):
    if request.param == "grpc":
        with OtlpGrpcReceiver() as receiver:
            yield Target(receiver, "grpc", receiver.endpoint)
    else:
        with OtlpHttpReceiver() as receiver:
            yield Target(receiver, "http/protobuf", receiver.metrics_endpoint)
