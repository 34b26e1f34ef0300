"""The local cluster's keys and tokens, made with openssl: one CA signs the API server's and the
agents' serving certificates (the webhook's comes from scripts/webhook-cert.sh, as a user makes it);
clients authenticate with static tokens (a token file is the API server's simplest real
authenticator); the service-account key pair signs pod tokens."""

from __future__ import annotations

import secrets
from pathlib import Path

from localcluster.layout import Layout, sh

SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service's address in --service-cluster-ip-range


def _cert(pki: Path, name: str, cn: str, sans: list[str]) -> None:
    key, csr, crt, ext = (pki / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    ext.write_text("subjectAltName=" + ",".join(sans) + "\nextendedKeyUsage=serverAuth,clientAuth\n")
    sh(
        "openssl",
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        f"/CN={cn}",
    )
    sh(
        "openssl",
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-CAcreateserial",
        "-days",
        "365",
        "-out",
        str(crt),
        "-extfile",
        str(ext),
    )
    key.chmod(0o600)


def _ca(pki: Path, name: str, cn: str) -> None:
    """A self-signed CA: PKI/NAME.key and PKI/NAME.crt."""
    key, crt = str(pki / f"{name}.key"), str(pki / f"{name}.crt")
    sh(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        key,
        "-out",
        crt,
        "-days",
        "365",
        "-subj",
        f"/CN={cn}",
    )


def make(lay: Layout) -> dict[str, str]:
    """Every key, certificate and token the cluster needs; returns the tokens by user."""
    pki = lay.pki
    pki.mkdir(parents=True, exist_ok=True)
    pki.chmod(0o700)
    _ca(pki, "ca", "criuctl-local-cluster-ca")
    ips = [lay.host_ip, "127.0.0.1", SERVICE_IP]
    names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "localhost"]
    _cert(pki, "apiserver", "kube-apiserver", [f"IP:{i}" for i in ips] + [f"DNS:{n}" for n in names])
    # criuctl's agents have a CA of their own, whose key goes to criuctl's controller: never the
    # cluster's, which would make the controller the API server
    _ca(pki, "criuctl-ca", "criuctl-agents-ca")
    sh("openssl", "genrsa", "-out", str(pki / "sa.key"), "2048")
    sh("openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    users = {
        "admin": ("admin", "system:masters"),
        "kube-scheduler": ("system:kube-scheduler", ""),
        "kube-controller-manager": ("system:kube-controller-manager", ""),
        # each node's kube-proxy: the name the default ClusterRoleBinding system:node-proxier binds
        "kube-proxy": ("system:kube-proxy", ""),
        **{f"node-{n}": (f"system:node:{n}", "system:nodes") for n in lay.nodes},
        # two plain users for the tests: one the tests grant criuctl-migrator alone, one nothing
        "migrator": ("migrator", ""),
        "outsider": ("outsider", ""),
    }
    tokens = {u: secrets.token_hex(16) for u in users}
    lines = [f'{tokens[u]},{name},{name},"{group}"' for u, (name, group) in users.items()]
    (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
    (pki / "tokens.csv").chmod(0o600)
    return tokens


def kubeconfig(lay: Layout, path: Path, token: str, server: str | None = None) -> Path:
    """A kubeconfig for one user (YAML is JSON's superset: written as JSON, read by every client)."""
    import json

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": server or lay.api_url,
                    "certificate-authority": str(lay.pki / "ca.crt"),
                },
            }
        ],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
        "current-context": "local",
    }
    path.write_text(json.dumps(cfg, indent=1))
    path.chmod(0o600)
    return path
