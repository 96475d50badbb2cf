"""Kafka security settings (SASL / TLS) reach every client, secrets never sit in the
config, and the HMAC signing of bus/signing.py without a broker."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from tapioca.bus.settings import BusConfig
from tapioca.bus.signing import SignatureError, SigningKey, create_key_file, load_key_file
from tapioca.config.loader import to_yaml
from tapioca.config.schema import TrainConfig
from tapioca.schemas.errors import ConfigError


def test_sasl_ssl_settings_reach_producer_consumer_and_admin(monkeypatch, tmp_path):
    monkeypatch.setenv("KAFKA_PW", "s3cret-pw")
    cfg = BusConfig(bootstrap_servers="kafka:9093", security_protocol="sasl_ssl",
                    sasl_mechanism="SCRAM-SHA-512", sasl_username="tapioca",
                    sasl_password_env="KAFKA_PW", ssl_ca_location="/etc/ca.pem")
    for conf in (cfg.producer_conf(), cfg.consumer_conf("g"), cfg.admin_conf()):
        assert conf["security.protocol"] == "SASL_SSL"
        assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
        assert conf["sasl.username"] == "tapioca" and conf["sasl.password"] == "s3cret-pw"
        assert conf["ssl.ca.location"] == "/etc/ca.pem"
        assert conf["ssl.endpoint.identification.algorithm"] == "https"
    # The password is read when a client is made; the config (and config.yaml) never holds it.
    train = TrainConfig(bus=cfg)
    assert "s3cret-pw" not in to_yaml(train) and "s3cret-pw" not in repr(cfg)
    assert "s3cret-pw" not in str(asdict(cfg))


def test_sasl_password_from_an_owner_only_file(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    pw.chmod(0o600)
    cfg = BusConfig(bootstrap_servers="k:9092", security_protocol="SASL_PLAINTEXT",
                    sasl_mechanism="PLAIN", sasl_username="u", sasl_password_file=str(pw))
    assert cfg.producer_conf()["sasl.password"] == "from-file"
    pw.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        cfg.producer_conf()


def test_plaintext_default_adds_nothing_and_bad_settings_say_how_to_fix():
    conf = BusConfig(bootstrap_servers="k:9092").producer_conf()
    assert not any(k.startswith(("security.", "sasl.", "ssl.")) for k in conf)
    with pytest.raises(ConfigError, match="SASL_SSL"):
        BusConfig(security_protocol="TLS")
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        BusConfig(security_protocol="SASL_SSL")
    with pytest.raises(ConfigError, match="sasl_username"):
        BusConfig(security_protocol="SASL_SSL", sasl_mechanism="PLAIN")
    with pytest.raises(ConfigError, match="needs bus.security_protocol"):
        BusConfig(sasl_mechanism="PLAIN")
    missing = BusConfig(bootstrap_servers="k:9092", security_protocol="SASL_SSL",
                        sasl_mechanism="PLAIN", sasl_username="u", sasl_password_env="NOPE_PW_X")
    with pytest.raises(ConfigError, match=r"\$NOPE_PW_X"):
        missing.consumer_conf("g")


def test_signatures_verify_only_under_the_same_key_and_value(tmp_path):
    key = create_key_file(tmp_path / "k" / "bus.key")
    assert load_key_file(tmp_path / "k" / "bus.key") == key
    assert key.secret.hex() not in repr(key)
    value = b'{"type":"weights","version":3}'
    header = [("tapioca.sig", key.sign(value))]
    key.verify(value, header)
    with pytest.raises(SignatureError, match="altered or forged"):
        key.verify(value.replace(b"3", b"4"), header)
    with pytest.raises(SignatureError, match="unsigned"):
        key.verify(value, [])
    other = SigningKey(b"x" * 32)
    with pytest.raises(SignatureError, match="another run"):
        other.verify(value, header)
    with pytest.raises(SignatureError, match="malformed"):
        key.verify(value, [("tapioca.sig", b"garbage")])
