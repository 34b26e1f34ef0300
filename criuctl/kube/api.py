"""How criuctl calls the Kubernetes API server: the one place that makes the official client's API
objects, so that none of them can wait forever.

The official client waits without end by default: a request carries no timeout unless the caller
passes `_request_timeout`, and urllib3 asks again three times after one that timed out. An API
server that accepts a connection and never answers (overloaded, half-partitioned, a proxy in
between) would then hold `criuctl migrate`, the webhook's admission (and the API server's own
request behind it) and the agents' moves loop for good. So every API object criuctl uses is made
here, wrapped in `Bounded`, which passes `_request_timeout` (connect, read) on every call from one
named setting (`KubeTimeouts`, overridable through CRIUCTL_KUBE_TIMEOUTS), and its client never
repeats a request the server let time out. A call that gets no answer raises `NoAnswer`, which
`criuctl.kube.cluster.api_error` turns into the one line "the API server does not answer". Nothing
else in criuctl constructs an API object or an ApiClient (tests/test_kube_timeouts.py checks).

Where a loop already asks again (the agents' moves loop, the PyTorchJob stand-in's poll), it does so
at its next turn, each attempt bounded; elsewhere a call that got no answer is the caller's failure.

Imports only the standard library, the kubernetes client and criuctl.core.errors: the local cluster's
PyTorchJob stand-in uses it too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from urllib3.exceptions import TimeoutError as Urllib3Timeout
from urllib3.util.retry import Retry

from criuctl.core import env
from criuctl.core.errors import CriuctlError

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class KubeTimeouts:
    """Every wait on the API server, in seconds: one place to read and tune them."""

    connect: float = 5.0  # TCP connect and TLS handshake
    read: float = 30.0  # for the answer (or its next bytes): a list of every pod is the slowest call
    retries: int = 1  # a request again after a connection refused, reset or dropped, never after a timeout
    # The webhook's pending-move lookup, made while the API server waits for the admission:
    # together well under manifests/webhook.yaml's timeoutSeconds (5), so that the webhook's own
    # answer, which says why, reaches the pod's creator rather than the API server's timeout.
    admission_connect: float = 1.0
    admission_read: float = 2.5

    def request(self) -> tuple[float, float]:
        """The official client's `_request_timeout`: (connect, read)."""
        return (self.connect, self.read)

    def admission(self) -> KubeTimeouts:
        """These timeouts for the webhook's lookup: its own budget, no second attempt."""
        return replace(self, connect=self.admission_connect, read=self.admission_read, retries=0)


def timeouts(raw: str | None = None) -> KubeTimeouts:
    """KubeTimeouts with the fields named in $CRIUCTL_KUBE_TIMEOUTS (or `raw`) overridden; a value
    that is not one is refused in one line (a typo would otherwise leave a wait unbounded)."""
    return env.overrides(env.KUBE_TIMEOUTS, KubeTimeouts, raw)


class NoAnswer(TimeoutError):
    """The API server did not answer within the timeouts. A builtin TimeoutError, so an OSError:
    whatever already caught a failed API call (`except OSError`) catches this one too."""

    def __init__(self, t: KubeTimeouts) -> None:
        super().__init__(
            f"no reply within its timeouts (connect {t.connect:g} s, read {t.read:g} s; {env.KUBE_TIMEOUTS})"
        )
        self.timeouts = t


class _NoRetryAfterTimeout(Retry):
    """urllib3's retry, less the retry of a request the server let time out: asking a server that
    does not answer again would only multiply the wait. A connection refused, reset or dropped
    before an answer is asked again, up to `total` times."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        if isinstance(error, Urllib3Timeout):
            raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)


class Bounded:
    """One of the official client's API objects (CoreV1Api, CustomObjectsApi, ...) whose every
    method carries the request timeout, and raises NoAnswer when it runs out. Attributes that are
    not API methods (`api_client`) pass through."""

    def __init__(self, api: Any, t: KubeTimeouts) -> None:
        self._api = api
        self.timeouts = t

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._api, name)
        if name.startswith("_") or not callable(attr) or name == "api_client":
            return attr

        @functools.wraps(attr)
        def bounded(*args: Any, **kw: Any) -> Any:
            if kw.get("_request_timeout") is None:  # a caller may give its own bound, never none
                kw["_request_timeout"] = self.timeouts.request()
            try:
                return attr(*args, **kw)
            except Urllib3Timeout as exc:  # connect, TLS handshake or read (never retried: api_client)
                raise NoAnswer(self.timeouts) from exc

        return bounded


def api_client(kubeconfig: str | None, t: KubeTimeouts) -> tuple[Any, str]:
    """An ApiClient of its own (never the module-global default configuration) from `kubeconfig`,
    or in a pod from its service account, and the context's namespace; one line if neither works."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    cfg = client.Configuration()
    try:
        if kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            _, ctx = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (ctx or {}).get("context", {}).get("namespace") or "default"
        else:
            config.load_incluster_config(client_configuration=cfg)
            namespace = SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else "default"
    except (ConfigException, OSError, TypeError) as exc:
        raise CriuctlError(
            f"no usable Kubernetes configuration ({exc})", "pass --kubeconfig FILE or set KUBECONFIG"
        ) from exc
    cfg.retries = _NoRetryAfterTimeout(total=t.retries)
    return client.ApiClient(cfg), namespace


def bounded(api_class: type, client_: Any, t: KubeTimeouts) -> Bounded:
    """`api_class` (e.g. kubernetes.client.CoreV1Api) on `client_`, every call bounded by `t`."""
    return Bounded(api_class(client_), t)
