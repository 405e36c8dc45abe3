"""The OpenAI-compatible client over HTTPS, against a real local TLS server.

docs/python.md: the server's certificate is verified (the system's CAs, or the file
``SSL_CERT_FILE`` names: a private CA's), and so is its name; a certificate that does not
verify fails the call at once (the server never received it: no retry), and the model call's
outcome is then unknown like any failed call. A client that stopped verifying would send the
API key and the conversation to whoever answers.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.models import ModelError, ModelRequest, OpenAIChatModel
from tests.interaction_io.fake_openai import FakeOpenAI, completion


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A private CA, and two server certificates it signed: one for 127.0.0.1 (where the test
    server listens), one for another name only."""
    if shutil.which("openssl") is None:  # Debian's openssl (the machine's): a missing one fails, never skips
        pytest.fail("the openssl command is needed to make the test certificates (apt-get install openssl)")
    where = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", "/CN=agentfold test CA", "-keyout", "ca.key", "-out", "ca.pem", cwd=where)
    for name, san in (("here", "IP:127.0.0.1"), ("elsewhere", "DNS:model.example.com")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
                 f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=where)
        (where / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=where)
    return {"ca": where / "ca.pem", "here": where / "here.pem", "elsewhere": where / "elsewhere.pem"}


def _server(certificates: dict[str, Path], which: str, script: list[dict[str, Any]]) -> FakeOpenAI:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates[which], certificates[which].with_suffix(".key"))
    return FakeOpenAI(script, tls=context)


def _request() -> ModelRequest:
    return ModelRequest(process_id="process:p", model_call_sequence=1, effect_id="effect:" + "0" * 64,  # type: ignore[arg-type]
                        attempt_id=None, messages=({"role": "user", "content": [{"type": "text", "text": "hi"}]},))


def _model(server: FakeOpenAI, waits: list[float]) -> OpenAIChatModel:
    model = OpenAIChatModel(server.base_url, "gpt-test", api_key="sk-secret", timeout=10, max_retries=2,
                            retry_wait=0.01)
    model.sleep = lambda seconds, cancelled: waits.append(seconds)  # type: ignore[method-assign]
    return model


def test_a_certificate_from_a_ca_the_client_does_not_trust_fails_the_call_at_once_and_sends_nothing(
    certificates: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    waits: list[float] = []
    with _server(certificates, "here", [completion("hello")]) as server:
        with pytest.raises(ModelError) as failed:
            _model(server, waits).call(_request())
    assert "unreachable" in str(failed.value) and "CERTIFICATE_VERIFY_FAILED" in str(failed.value), failed.value
    assert server.requests == [] and waits == []  # neither the key nor the conversation was sent; not retried


def test_a_private_ca_named_by_ssl_cert_file_is_trusted(certificates: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    with _server(certificates, "here", [completion("hello over TLS")]) as server:
        model = _model(server, waits)
        monkeypatch.setenv("SSL_CERT_FILE", str(certificates["ca"]))  # read at each connection, as documented
        response = model.call(_request())
    assert response["message"]["content"][0]["text"] == "hello over TLS", response
    assert len(server.requests) == 1 and server.headers[0]["Authorization"] == "Bearer sk-secret"


def test_a_trusted_certificate_for_another_name_fails_the_call(certificates: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates["ca"]))
    waits: list[float] = []
    with _server(certificates, "elsewhere", [completion("hello")]) as server:
        with pytest.raises(ModelError) as failed:
            _model(server, waits).call(_request())
    assert "unreachable" in str(failed.value) and "mismatch" in str(failed.value).lower(), failed.value
    assert server.requests == [] and waits == []
