"""Issue 56 M5: every component that opens a rendezvous itself (the KV connectors, weight
sync, verl's checkpoint engine) connects with the operator's security settings — the cluster
secret, etcd's TLS and user — from its engine config or the environment
(``xfer.rendezvous_security``), and a combination that cannot work is refused when the
component starts, naming the setting and where it came from."""

import ast
import pathlib
import re

import pytest

import xfer
from conftest import MOCK
from xfer.rendezvous_security import ENV, RendezvousSecurity
from xfer.weights.engines import FullTensorSender, StagedReceiver

PACKAGE = pathlib.Path(xfer.__file__).parent
SOURCE_PACKAGE = pathlib.Path(__file__).parents[1] / "xfer"


def private(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def no_settings(monkeypatch):
    """No setting from the test runner's environment (an operator's shell may have some)."""
    for name in (*ENV.values(), "XFER_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_each_setting_comes_from_the_engine_config_else_the_environment(tmp_path, no_settings):
    env = {"XFER_ETCD_CA_FILE": "/env/ca.pem", "XFER_ETCD_DOMAIN": "etcd.env",
           "XFER_SECRET_FILE": "/env/secret"}
    config = {"backend": "mock", "rendezvous": {"etcd_ca_file": "/config/ca.pem"}}
    s = RendezvousSecurity.of(config, environ=env)
    assert s.options() == {"etcd_ca_file": "/config/ca.pem", "etcd_domain": "etcd.env",
                           "secret_file": "/env/secret"}
    assert s.sources["etcd_ca_file"] == "[rendezvous] etcd_ca_file in the engine config"
    assert s.sources["etcd_domain"] == "$XFER_ETCD_DOMAIN"
    # A TOML path is read as the engine reads it; None means $XFER_CONFIG.
    toml = tmp_path / "xfer.toml"
    toml.write_text('backend = "mock"\n[rendezvous]\netcd_ca_file = "/file/ca.pem"\n'
                    'etcd_user = "xfer"\netcd_password_file = "/file/pw"\n'
                    '[security]\nsecret_file = "/env/secret"\n')
    for given, environ in ((str(toml), env), (None, {**env, "XFER_CONFIG": str(toml)})):
        s = RendezvousSecurity.of(given, environ=environ)
        assert s.options() == {"etcd_ca_file": "/file/ca.pem", "etcd_user": "xfer",
                               "etcd_password_file": "/file/pw", "etcd_domain": "etcd.env",
                               "secret_file": "/env/secret"}
        assert s.sources["etcd_user"] == f"[rendezvous] etcd_user in {toml}"
    assert RendezvousSecurity.of(None, environ={}).options() == {}


def test_a_password_without_tls_is_refused_naming_the_settings(no_settings):
    env = {"XFER_ETCD_USER": "xfer", "XFER_ETCD_PASSWORD_FILE": "/run/pw"}
    with pytest.raises(xfer.ConfigError) as e:
        RendezvousSecurity.of(None, environ=env, who="XferConnector")
    text = str(e.value)
    assert text.startswith("XferConnector: ")
    assert "etcd_password_file ($XFER_ETCD_PASSWORD_FILE)" in text
    assert "$XFER_ETCD_CA_FILE" in text and "cleartext" in text
    # With the CA (TLS) the same user is accepted.
    assert RendezvousSecurity.of(None, environ={**env, "XFER_ETCD_CA_FILE": "/ca"}).etcd_user == "xfer"


@pytest.mark.parametrize(("settings", "named"), [
    ({"etcd_user": "xfer", "etcd_ca_file": "/ca"}, "etcd_user ([rendezvous] etcd_user in the engine config) is set without etcd_password_file"),
    ({"etcd_password_file": "/pw", "etcd_ca_file": "/ca"}, "etcd_password_file ([rendezvous] etcd_password_file in the engine config) is set without etcd_user"),
    ({"etcd_cert_file": "/c", "etcd_ca_file": "/ca"}, "etcd_cert_file ([rendezvous] etcd_cert_file in the engine config) is set without etcd_key_file"),
    ({"etcd_cert_file": "/c", "etcd_key_file": "/k"}, "etcd_cert_file ([rendezvous] etcd_cert_file in the engine config) asks for etcd over TLS, which needs etcd_ca_file"),
    ({"etcd_domain": "etcd.local"}, "etcd_domain ([rendezvous] etcd_domain in the engine config) asks for etcd over TLS"),
])
def test_combinations_etcds_client_would_refuse_are_refused_at_once(settings, named, no_settings):
    with pytest.raises(xfer.ConfigError, match=re.escape(named)):
        RendezvousSecurity.of({"backend": "mock", "rendezvous": settings}, environ={})


def test_the_cluster_secret_is_one_file_wherever_it_is_named(tmp_path, no_settings):
    one, other = private(tmp_path / "one", "x" * 32), private(tmp_path / "other", "y" * 32)
    config = {"backend": "mock", "security": {"secret_file": str(one)}}
    with pytest.raises(xfer.ConfigError, match=r"secret_file= names .*one but \$XFER_SECRET_FILE names .*other"):
        RendezvousSecurity.of(config, secret_file=one, environ={"XFER_SECRET_FILE": str(other)})
    with pytest.raises(xfer.ConfigError, match=r"\[security\] secret_file in the engine config names .*one"):
        RendezvousSecurity.of(config, environ={"XFER_SECRET_FILE": str(other)})
    same = RendezvousSecurity.of(config, secret_file=one, environ={"XFER_SECRET_FILE": str(one)})
    assert same.secret_file == str(one) and same.sources["secret_file"] == "secret_file="


def test_no_component_opens_a_rendezvous_but_through_the_settings():
    """Every ``xfer.Rendezvous(...)`` and ``xfer.Server(...)`` of the package's components
    is made in ``rendezvous_security`` or given its settings: a new call site that dials
    with none (plaintext, unauthenticated etcd; no cluster secret) fails here."""
    offenders = []
    for path in sorted(SOURCE_PACKAGE.rglob("*.py")):
        if path.name == "rendezvous_security.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "Rendezvous":
                offenders.append(f"{path.relative_to(SOURCE_PACKAGE)}:{node.lineno}: Rendezvous(...)")
            elif name == "Server" and not any(
                    k.arg == "secret_file" and ast.unparse(k.value).endswith(".secret_file")
                    for k in node.keywords):
                offenders.append(f"{path.relative_to(SOURCE_PACKAGE)}:{node.lineno}: Server(...) without "
                                 "a resolved secret_file")
    assert not offenders, offenders


def test_weight_sync_members_reach_a_service_with_the_secret_their_engine_config_names(tmp_path, no_settings):
    """The secret only in the engine config (no ``$XFER_SECRET_FILE``): both kinds of member
    get into a service that admits only holders of it, and publish there."""
    secret = private(tmp_path / "secret", "s" * 32)
    config = dict(MOCK, security={"secret_file": str(secret)})
    server = xfer.Server(secret_file=secret)
    try:
        sender = FullTensorSender(rendezvous=server.url, group="m5", receivers=1, config=config, timeout=5)
        receiver = StagedReceiver(rendezvous=server.url, group="m5", rank=0, receivers=1, config=config, timeout=5)
        try:
            names = {r["name"] for r in xfer.Rendezvous(server.url, secret_file=secret, connect_timeout=5).list()}
            assert {"m5.s0", "m5.r0"} <= names, names
        finally:
            receiver.close()
            sender.close()
    finally:
        server.close()


def test_weight_sync_refuses_a_password_without_tls_when_it_starts(tmp_path, monkeypatch, no_settings):
    password = private(tmp_path / "password", "pw\n")
    monkeypatch.setenv("XFER_ETCD_USER", "xfer")
    monkeypatch.setenv("XFER_ETCD_PASSWORD_FILE", str(password))
    server = xfer.Server()
    try:
        for make in (lambda: FullTensorSender(rendezvous=server.url, group="m5", receivers=1, config=MOCK, timeout=5),
                     lambda: StagedReceiver(rendezvous=server.url, group="m5", rank=0, receivers=1, config=MOCK, timeout=5)):
            with pytest.raises(xfer.ConfigError, match=r"etcd_password_file \(\$XFER_ETCD_PASSWORD_FILE\).*cleartext"):
                make()
    finally:
        server.close()


def test_weight_sync_members_hand_their_etcd_settings_to_the_rendezvous(tmp_path, monkeypatch, no_settings):
    """The settings reach ``xfer.Rendezvous`` (recorded on the way; the real client then
    connects: ``xfer://`` ignores the etcd ones, which only an ``etcd://`` URL uses)."""
    dialled = []
    real = xfer.Rendezvous

    def recording(url, **options):
        dialled.append((url, options))
        return real(url, **options)

    monkeypatch.setattr(xfer, "Rendezvous", recording)
    monkeypatch.setenv("XFER_ETCD_CA_FILE", str(tmp_path / "ca.pem"))
    config = dict(MOCK, rendezvous={"etcd_user": "xfer", "etcd_password_file": str(tmp_path / "pw")})
    server = xfer.Server()
    try:
        FullTensorSender(rendezvous=server.url, group="m5", receivers=1, config=config, timeout=5).close()
    finally:
        server.close()
    assert dialled == [(server.url, {"connect_timeout": 30.0, "etcd_ca_file": str(tmp_path / "ca.pem"),
                                     "etcd_user": "xfer", "etcd_password_file": str(tmp_path / "pw")})]
