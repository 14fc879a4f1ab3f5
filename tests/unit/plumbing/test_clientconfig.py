"""Java client.properties to librdkafka: translations, rejections, and secrets kept out of sight.

The translated configurations are also handed to a real librdkafka client
(no broker needed: creating one validates every key and loads TLS files).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kdelay.plumbing.clientconfig import (
    JAVA_ONLY,
    ClientConfigError,
    ClientLogger,
    ClientProperties,
    is_secret,
    parse_jaas,
    secret_values,
    translate,
)
from kdelay.plumbing.settings import Settings, SettingsError, build_settings

PASSWORD = "pa55-w0rd-that-must-not-leak"  # noqa: S105 - a test credential
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"


def jaas(module: str, **options: str) -> str:
    return module + " required " + " ".join(f'{k}="{v}"' for k, v in options.items()) + ";"


def accepted_by_librdkafka(config: dict[str, str]) -> None:
    """Creating a client validates every key and value (and reads TLS files) locally."""
    Producer({"bootstrap.servers": "127.0.0.1:1", **config, "logger": ClientLogger("test")})


# --- sasl.jaas.config ------------------------------------------------------------------


def test_scram_jaas_becomes_username_and_password() -> None:
    config = translate({"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                        "sasl.jaas.config": jaas(SCRAM, username="alice", password=PASSWORD)})
    assert config == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                      "sasl.username": "alice", "sasl.password": PASSWORD}
    accepted_by_librdkafka(config)


def test_plain_jaas_sets_the_mechanism_when_missing() -> None:
    config = translate({"security.protocol": "SASL_PLAINTEXT",
                        "sasl.jaas.config": jaas(PLAIN, username="bob", password=PASSWORD)})
    assert config["sasl.mechanism"] == "PLAIN"
    assert (config["sasl.username"], config["sasl.password"]) == ("bob", PASSWORD)
    accepted_by_librdkafka(config)


@pytest.mark.parametrize(
    ("text", "options"),
    [
        (f'{SCRAM} required username="a" password="p";', {"username": "a", "password": "p"}),
        (f"  {SCRAM}   required\n  username=a\n  password=p ;  ",
         {"username": "a", "password": "p"}),
        (f'{SCRAM} required username="a b" password="x\\"y\\\\z;w";',
         {"username": "a b", "password": 'x"y\\z;w'}),
        (f'{SCRAM} required password="=;\'";', {"password": "=;'"}),
        (f"{SCRAM} optional;", {}),
        (f"{SCRAM} required username='a' password='p\\'q\"';",
         {"username": "a", "password": "p'q\""}),
    ],
)
def test_jaas_parsing(text: str, options: dict[str, str]) -> None:
    login = parse_jaas(text)
    assert login.module == SCRAM
    assert dict(login.options) == options


@pytest.mark.parametrize(
    "text",
    [
        f'username="a" password="{PASSWORD}";',
        f'{SCRAM} username="a" password="{PASSWORD}";',
        f'{SCRAM} required username="a" password="{PASSWORD}"',
        f'{SCRAM} required username="a" password="{PASSWORD};',
        f'{SCRAM} required username="a" password="{PASSWORD}"; {PLAIN} required;',
    ],
)
def test_malformed_jaas_never_echoes_the_password(text: str) -> None:
    with pytest.raises(ClientConfigError) as raised:
        translate({"sasl.jaas.config": text})
    assert raised.value.code == "kafka-config-malformed"
    assert PASSWORD not in str(raised.value)
    assert PASSWORD not in repr(raised.value)


def test_jaas_login_repr_hides_option_values() -> None:
    login = parse_jaas(jaas(SCRAM, username="alice", password=PASSWORD))
    assert PASSWORD not in repr(login)
    assert "password" in repr(login)


@pytest.mark.parametrize(
    ("properties", "fragment"),
    [
        ({"sasl.jaas.config": jaas(SCRAM, username="a", password=PASSWORD)},
         "SCRAM-SHA-256 or SCRAM-SHA-512"),
        ({"sasl.mechanism": "SCRAM-SHA-256", "sasl.jaas.config": jaas(PLAIN, username="a",
                                                                       password=PASSWORD)},
         "does not match the JAAS PlainLoginModule"),
        ({"sasl.mechanism": "PLAIN", "sasl.jaas.config": jaas(SCRAM, username="a",
                                                               password=PASSWORD)},
         "does not match the JAAS ScramLoginModule"),
        ({"sasl.mechanism": "PLAIN", "sasl.jaas.config": jaas(PLAIN, password=PASSWORD)},
         "needs both username and password"),
        ({"sasl.mechanism": "PLAIN", "sasl.jaas.config": jaas(PLAIN, username="a",
                                                               password=PASSWORD, x="1")},
         "option(s) x have no librdkafka equivalent"),
        ({"sasl.jaas.config": jaas("org.apache.kafka.common.security.oauthbearer."
                                   "OAuthBearerLoginModule", clientSecret=PASSWORD)},
         "sasl.oauthbearer.method=oidc"),
        ({"sasl.jaas.config": jaas("com.example.Custom", secret=PASSWORD)},
         "com.example.Custom is unknown to librdkafka"),
    ],
)
def test_unusable_jaas_is_rejected_without_the_password(
    properties: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ClientConfigError) as raised:
        translate(properties)
    assert raised.value.code == "kafka-config-unsupported"
    assert fragment in str(raised.value)
    assert PASSWORD not in str(raised.value)


def test_kerberos_jaas_becomes_sasl_kerberos_settings() -> None:
    text = ('com.sun.security.auth.module.Krb5LoginModule required useKeyTab=true '
            'storeKey=true keyTab="/etc/k.keytab" principal="kdelay@EXAMPLE.COM";')
    config = translate({"sasl.mechanism": "GSSAPI", "sasl.jaas.config": text})
    assert config == {"sasl.mechanism": "GSSAPI", "sasl.kerberos.keytab": "/etc/k.keytab",
                      "sasl.kerberos.principal": "kdelay@EXAMPLE.COM"}


# --- trust and key stores --------------------------------------------------------------


@pytest.fixture(scope="module")
def pem_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed certificate and its key as PEM files (openssl), plus both in one file."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("pem")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=kdelay-test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    both = folder / "keystore.pem"
    both.write_text(key.read_text() + cert.read_text())
    return {"cert": cert, "key": key, "keystore": both}


def test_pem_truststore_file_becomes_ssl_ca_location(pem_files: dict[str, Path]) -> None:
    config = translate({"security.protocol": "SSL", "ssl.truststore.type": "PEM",
                        "ssl.truststore.location": str(pem_files["cert"])})
    assert config == {"security.protocol": "SSL", "ssl.ca.location": str(pem_files["cert"])}
    accepted_by_librdkafka(config)


def test_inline_pem_truststore_becomes_ssl_ca_pem(pem_files: dict[str, Path]) -> None:
    text = pem_files["cert"].read_text()
    config = translate({"security.protocol": "SSL", "ssl.truststore.type": "PEM",
                        "ssl.truststore.certificates": text})
    assert config == {"security.protocol": "SSL", "ssl.ca.pem": text}
    accepted_by_librdkafka(config)


def test_pem_keystore_file_gives_key_and_certificate(pem_files: dict[str, Path]) -> None:
    keystore = str(pem_files["keystore"])
    config = translate({"security.protocol": "SSL", "ssl.keystore.type": "PEM",
                        "ssl.keystore.location": keystore})
    assert config == {"security.protocol": "SSL", "ssl.key.location": keystore,
                      "ssl.certificate.location": keystore}
    accepted_by_librdkafka(config)


def test_inline_pem_keystore(pem_files: dict[str, Path]) -> None:
    key, chain = pem_files["key"].read_text(), pem_files["cert"].read_text()
    config = translate({"security.protocol": "SSL", "ssl.keystore.type": "PEM",
                        "ssl.keystore.key": key, "ssl.keystore.certificate.chain": chain})
    assert config == {"security.protocol": "SSL", "ssl.key.pem": key,
                      "ssl.certificate.pem": chain}
    accepted_by_librdkafka(config)


def test_pkcs12_keystore_is_read_by_librdkafka(
    pem_files: dict[str, Path], tmp_path: Path
) -> None:
    p12 = tmp_path / "client.p12"
    subprocess.run(["openssl", "pkcs12", "-export", "-in", str(pem_files["cert"]),
                    "-inkey", str(pem_files["key"]), "-out", str(p12),
                    "-passout", f"pass:{PASSWORD}"], check=True, capture_output=True)
    config = translate({"security.protocol": "SSL", "ssl.keystore.type": "PKCS12",
                        "ssl.keystore.location": str(p12), "ssl.keystore.password": PASSWORD})
    assert config == {"security.protocol": "SSL", "ssl.keystore.location": str(p12),
                      "ssl.keystore.password": PASSWORD}
    accepted_by_librdkafka(config)


@pytest.mark.parametrize(
    ("properties", "fragment"),
    [
        ({"ssl.truststore.location": "/x/trust.jks", "ssl.truststore.password": PASSWORD},
         "keytool -exportcert -rfc"),
        ({"ssl.truststore.type": "PKCS12", "ssl.truststore.location": "/x/trust.p12"},
         "openssl pkcs12 -in /x/trust.p12 -nokeys -out ca.pem"),
        ({"ssl.keystore.location": "/x/client.jks", "ssl.keystore.password": PASSWORD},
         "keytool -importkeystore -srckeystore /x/client.jks"),
    ],
)
def test_java_stores_are_rejected_with_how_to_convert(
    properties: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ClientConfigError) as raised:
        translate(properties)
    assert fragment in str(raised.value)
    assert PASSWORD not in str(raised.value)


# --- renamed and Java-only keys ----------------------------------------------------------


def test_renamed_keys_and_the_empty_host_check() -> None:
    config = translate({"send.buffer.bytes": "-1", "receive.buffer.bytes": "65536",
                        "max.request.size": "2000000",
                        "ssl.endpoint.identification.algorithm": ""})
    assert config == {"socket.send.buffer.bytes": "0", "socket.receive.buffer.bytes": "65536",
                      "message.max.bytes": "2000000",
                      "ssl.endpoint.identification.algorithm": "none"}
    accepted_by_librdkafka(config)


def test_librdkafka_keys_pass_through() -> None:
    properties = {"linger.ms": "5", "acks": "all", "client.id": "x", "sasl.username": "u",
                  "sasl.password": PASSWORD, "sasl.mechanism": "PLAIN",
                  "security.protocol": "SASL_PLAINTEXT"}
    assert translate(properties) == properties


def test_every_java_only_key_is_named_with_its_alternative() -> None:
    with pytest.raises(ClientConfigError) as raised:
        translate(dict.fromkeys(JAVA_ONLY, "x"))
    message = str(raised.value)
    assert raised.value.code == "kafka-config-unsupported"
    for key, advice in JAVA_ONLY.items():
        assert f"{key}: {advice}" in message
    assert "buffer.memory: use queue.buffering.max.kbytes" in message


# --- secrets out of sight ----------------------------------------------------------------


def test_is_secret() -> None:
    assert all(map(is_secret, ["sasl.password", "ssl.key.password", "sasl.jaas.config",
                               "ssl.keystore.password", "ssl.key.pem",
                               "sasl.oauthbearer.client.secret", "ssl.keystore.key"]))
    assert not any(map(is_secret, ["sasl.username", "ssl.ca.location", "ssl.key.location"]))


def test_client_properties_repr_hides_secrets() -> None:
    props = ClientProperties({"sasl.username": "alice", "sasl.password": PASSWORD})
    assert PASSWORD not in repr(props)
    assert "'sasl.password': '***'" in repr(props)
    assert "alice" in repr(props)
    assert props["sasl.password"] == PASSWORD
    assert props == {"sasl.username": "alice", "sasl.password": PASSWORD}
    assert secret_values(props) == (PASSWORD,)


def test_settings_repr_and_str_hide_the_password(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text(f"security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-256\n"
                    f"sasl.jaas.config={jaas(SCRAM, username='alice', password=PASSWORD)}\n")
    settings = build_settings(kafka_config_path=path)
    assert settings.kafka_config["sasl.password"] == PASSWORD
    assert PASSWORD not in repr(settings)
    assert PASSWORD not in str(settings)
    assert "sasl.username': 'alice'" in repr(settings)


def test_unsupported_file_is_a_settings_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text(f"ssl.truststore.location=/t.jks\nssl.truststore.password={PASSWORD}\n")
    with pytest.raises(SettingsError) as raised:
        build_settings(kafka_config_path=path)
    assert raised.value.code == "kafka-config-unsupported"
    assert str(path) in str(raised.value)
    assert PASSWORD not in str(raised.value)


def test_malformed_unicode_escape_in_a_password_is_not_echoed(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text("sasl.password=ab\\uWXYZcd\n")
    with pytest.raises(SettingsError) as raised:
        build_settings(kafka_config_path=path)
    assert "WXYZ" not in str(raised.value)
    assert "value of sasl.password" in str(raised.value)


# --- librdkafka's log lines ---------------------------------------------------------------


def test_client_logger_scrubs_secrets_and_names_the_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = ClientLogger("targets", (PASSWORD,))
    with caplog.at_level(logging.DEBUG, logger="kdelay.kafka"):
        logger.log(logging.WARNING, "%s [%s] %s", "FAIL", "rdkafka#producer-1",
                   f"auth with {PASSWORD} failed")
        logger.log(logging.INFO, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "idle: closed")
    warning, info = caplog.records
    assert warning.name == "kdelay.kafka.targets"
    assert warning.levelno == logging.WARNING
    assert warning.getMessage() == "FAIL [rdkafka#producer-1] auth with *** failed"
    assert info.levelno == logging.DEBUG  # librdkafka's informational lines are detail



def test_a_repeating_connection_failure_is_logged_once_a_minute_by_each_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client whose broker stays away (a retry helper, a producer of the client
    library) logs librdkafka's failed connections once a minute, not once a try."""
    now = [100.0]
    logger = ClientLogger("retry", monotonic=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="kdelay.kafka"):
        for _ in range(30):  # librdkafka's tries within the minute
            logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "refused")
            now[0] += 1.0
        logger.log(logging.WARNING, "%s [%s] %s", "GETPID", "rdkafka#producer-1", "retrying")
        logger.log(logging.INFO, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "idle: closed")
        now[0] += 30.0
        logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "refused")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "FAIL [rdkafka#producer-1] refused"),
        (logging.WARNING, "GETPID [rdkafka#producer-1] retrying"),  # another kind
        (logging.DEBUG, "FAIL [rdkafka#producer-1] idle: closed"),  # detail, not counted
        (logging.ERROR, "FAIL [rdkafka#producer-1] refused"),  # a minute on
    ]


def test_librdkafkas_fatal_line_is_detail_for_kdelay_says_it_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A static member fenced after an outage: librdkafka logs it as CRITICAL, then the
    service replaces the consumer (or ends with error[fenced]) and says so itself."""
    logger = ClientLogger("intake")
    with caplog.at_level(logging.DEBUG, logger="kdelay.kafka"):
        logger.log(logging.CRITICAL, "%s [%s] %s", "FATAL", "rdkafka#consumer-11",
                   "Fatal error: Broker: Static consumer fenced by other consumer")
        logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-11", "refused")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.ERROR]

def test_the_warning_about_the_gapless_changelog_producer_is_detail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kdelay sets ``enable.gapless.guarantee`` on purpose: a real producer's CONFWARN about
    it is not shown at INFO, while other configuration warnings are."""
    with caplog.at_level(logging.INFO, logger="kdelay.kafka"):
        for other in ({"enable.gapless.guarantee": True}, {"group.id": "not-for-a-producer"}):
            producer = Producer({"bootstrap.servers": "127.0.0.1:1", "enable.idempotence": True,
                                 **other, "logger": ClientLogger("changelog")})
            producer.poll(0.1)  # serves the log lines
    texts = [r.getMessage() for r in caplog.records]
    assert not any("gapless" in text for text in texts), texts
    assert any("CONFWARN" in text for text in texts), texts


def test_librdkafka_lines_reach_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    """A client of a closed port logs its connection failure through ``kdelay.kafka.<client>``,
    never to stderr, and with the password scrubbed even from debug output."""
    settings = Settings(bootstrap_servers="127.0.0.1:1", kafka_config={
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
        "sasl.username": "alice", "sasl.password": PASSWORD, "debug": "conf,security"})
    with caplog.at_level(logging.DEBUG, logger="kdelay.kafka"):
        producer = Producer(settings.client_config("unit"))
        for _ in range(50):
            producer.poll(0.1)
            if any("Connection refused" in r.getMessage() for r in caplog.records):
                break
    names = {record.name for record in caplog.records}
    assert names == {"kdelay.kafka.unit"}
    assert any(re.search(r"\[rdkafka#producer-\d+\].*Connection refused", r.getMessage())
               for r in caplog.records)
    assert all(PASSWORD not in record.getMessage() for record in caplog.records)
