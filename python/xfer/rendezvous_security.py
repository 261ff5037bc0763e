"""The operator's rendezvous security settings, for the components that open a rendezvous
themselves (the KV connectors, weight sync, verl's checkpoint engine): the one place they
connect through, so an ``etcd://`` they dial gets the operator's TLS and user, and the
embedded service the cluster secret, whichever component dials it.

Each setting is the keyword ``xfer.Rendezvous`` takes, read — the first that names it wins —
from an explicit argument of the component (verl's ``secret_file``), the xfer engine config the
component is given (``[rendezvous] etcd_*``, ``[security] secret_file``: the file the Rust
API and the CLI read, ``$XFER_CONFIG`` when none is given), else the environment:

=====================  ===========================  ====================================
setting                environment                  engine config
=====================  ===========================  ====================================
``secret_file``        ``$XFER_SECRET_FILE``        ``[security] secret_file``
``etcd_ca_file``       ``$XFER_ETCD_CA_FILE``       ``[rendezvous] etcd_ca_file``
``etcd_cert_file``     ``$XFER_ETCD_CERT_FILE``     ``[rendezvous] etcd_cert_file``
``etcd_key_file``      ``$XFER_ETCD_KEY_FILE``      ``[rendezvous] etcd_key_file``
``etcd_domain``        ``$XFER_ETCD_DOMAIN``        ``[rendezvous] etcd_domain``
``etcd_user``          ``$XFER_ETCD_USER``          ``[rendezvous] etcd_user``
``etcd_password_file`` ``$XFER_ETCD_PASSWORD_FILE`` ``[rendezvous] etcd_password_file``
=====================  ===========================  ====================================

The cluster secret is one file wherever it is named: two places naming different files are
refused, naming both (as the engine refuses its config's against ``$XFER_SECRET_FILE``).
Combinations etcd's client would refuse only when it dials — and only in a build with the
``etcd`` feature — are refused when the component starts, naming each setting and where it
came from: a user without TLS (its password would cross the network in cleartext), a user
without a password file or the reverse, a client certificate without its key or the
reverse, any TLS setting without the CA.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xfer

__all__ = ["ENV", "RendezvousSecurity"]

_ETCD = ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_domain", "etcd_user",
         "etcd_password_file")
SETTINGS = ("secret_file", *_ETCD)
ENV = {name: f"XFER_{name.upper()}" for name in SETTINGS}
"""The environment variable of each setting."""


@dataclasses.dataclass(frozen=True)
class RendezvousSecurity:
    """The settings a component's rendezvous clients connect with (``of`` resolves and
    checks them), and where each came from, for the errors that name it."""

    secret_file: str | None = None
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_domain: str | None = None
    etcd_user: str | None = None
    etcd_password_file: str | None = None
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    """Setting → where it was named (``$XFER_ETCD_CA_FILE``, ``[rendezvous] etcd_ca_file in
    /etc/xfer.toml``, ``secret_file=``)."""

    @staticmethod
    def of(engine_config: str | os.PathLike[str] | Mapping[str, Any] | None = None, *,
           secret_file: str | os.PathLike[str] | None = None, who: str = "xfer",
           environ: Mapping[str, str] | None = None) -> RendezvousSecurity:
        """The settings of a component given ``engine_config`` (a TOML path, a dict, or
        ``None``: ``$XFER_CONFIG`` if set) and its explicit ``secret_file``; raises
        ``xfer.ConfigError`` (prefixed with ``who``) for a combination that cannot work."""
        env = os.environ if environ is None else environ
        found: dict[str, str] = {}
        sources: dict[str, str] = {}
        secrets: list[tuple[str, str]] = []
        if secret_file is not None and str(secret_file):
            secrets.append((str(secret_file), "secret_file="))
        tables, where = _tables(engine_config, env, who)
        for name in SETTINGS:
            table = "security" if name == "secret_file" else "rendezvous"
            value = tables.get(table, {}).get(name)
            if value is not None and str(value):
                if name == "secret_file":
                    secrets.append((str(value), f"[security] secret_file in {where}"))
                else:
                    found[name], sources[name] = str(value), f"[{table}] {name} in {where}"
            value = env.get(ENV[name])
            if value:
                if name == "secret_file":
                    secrets.append((value, f"${ENV[name]}"))
                elif name not in found:
                    found[name], sources[name] = value, f"${ENV[name]}"
        if secrets:
            (first, first_source), *others = secrets
            for other, other_source in others:
                if not _same_file(first, other):
                    raise xfer.ConfigError(
                        f"{who}: {first_source} names {first} but {other_source} names {other}: "
                        "one cluster secret keys the rendezvous and the engine's handshake; "
                        "name the same file (or only one)")
            found["secret_file"], sources["secret_file"] = first, first_source
        security = RendezvousSecurity(**found, sources=sources)
        security._check(who)
        return security

    def options(self) -> dict[str, str]:
        """``xfer.Rendezvous``'s keywords for the settings that are set."""
        return {name: getattr(self, name) for name in SETTINGS if getattr(self, name) is not None}

    def connect(self, url: str, *, connect_timeout: float = 30.0) -> xfer.Rendezvous:
        """A rendezvous client of ``url`` with these settings (``xfer://``: the secret;
        ``etcd://``: TLS and the user too)."""
        return xfer.Rendezvous(url, connect_timeout=connect_timeout, **self.options())

    def _named(self, name: str) -> str:
        source = self.sources.get(name)
        return f"{name} ({source})" if source else name

    def _check(self, who: str) -> None:
        def refuse(why: str) -> None:
            raise xfer.ConfigError(f"{who}: {why}")

        def fix(name: str) -> str:
            return f"${ENV[name]} or [rendezvous] {name}"

        if self.etcd_password_file is not None and self.etcd_user is None:
            refuse(f"{self._named('etcd_password_file')} is set without etcd_user ({fix('etcd_user')})")
        if self.etcd_user is not None and self.etcd_password_file is None:
            refuse(f"{self._named('etcd_user')} is set without etcd_password_file "
                   f"({fix('etcd_password_file')}: a file holding the password)")
        if self.etcd_user is not None and self.etcd_ca_file is None:
            refuse(f"{self._named('etcd_user')} and {self._named('etcd_password_file')} are set "
                   f"without etcd_ca_file ({fix('etcd_ca_file')}): etcd's password would cross "
                   "the network in cleartext; etcd user authentication needs TLS")
        cert, key = self.etcd_cert_file, self.etcd_key_file
        if (cert is None) != (key is None):
            given, missing = ("etcd_cert_file", "etcd_key_file") if key is None else \
                ("etcd_key_file", "etcd_cert_file")
            refuse(f"{self._named(given)} is set without {missing} ({fix(missing)}): a client "
                   "certificate needs both")
        for name in ("etcd_cert_file", "etcd_key_file", "etcd_domain"):
            if getattr(self, name) is not None and self.etcd_ca_file is None:
                refuse(f"{self._named(name)} asks for etcd over TLS, which needs etcd_ca_file "
                       f"({fix('etcd_ca_file')}: the CA that signed etcd's certificate)")


def _tables(config: Any, env: Mapping[str, str], who: str) -> tuple[dict[str, Any], str]:
    """The engine config's tables as the engine reads them (``None``: ``$XFER_CONFIG``, else
    none), and how to name the config in errors."""
    if config is None:
        config = env.get("XFER_CONFIG") or None
        if config is None:
            return {}, ""
    if isinstance(config, Mapping):
        tables, where = dict(config), "the engine config"
    else:
        where = str(config)
        try:
            with open(config, "rb") as f:
                tables = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise xfer.ConfigError(f"{who}: cannot read the engine config {where}: {e}") from e
    for table in ("rendezvous", "security"):
        if not isinstance(tables.get(table, {}), Mapping):
            raise xfer.ConfigError(f"{who}: [{table}] in {where} is not a table")
    return tables, where


def _same_file(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).samefile(b)
    except OSError:
        return False
