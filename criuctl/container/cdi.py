"""CDI devices (the Container Device Interface): which a container was given, and whether a
placeholder was given the same kinds.

On a node with CDI on (the GPU Operator's, containerd 2.x's `enable_cdi`), a device plugin names a
container's devices as CDI devices, `vendor.com/class=name` (`nvidia.com/gpu=0`), and the runtime
edits the container's spec from the node's CDI specs: device nodes, mounts, environment. The names
reach the runtime as the container's `cdi.k8s.io/<key>` annotations, a comma-separated list per key
(the form every containerd and CRI-O version with CDI reads; the CRI's own CDIDevices field is not
in the CRI version criuctl speaks).

What moves with a job is the job, not its devices: the target's placeholder has whatever the
target's device plugin gave it (another GPU index, another device node). So a restore asks for the
same *kinds* in at least the same number, never the same names: a job that had two
`nvidia.com/gpu` devices needs a placeholder with two, whichever they are.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping

ANNOTATION_PREFIX = "cdi.k8s.io/"
# vendor (a domain, maybe with a path) / class = name, as the CDI specification's parser accepts them
_QUALIFIED = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9.\-]*(?:/[A-Za-z0-9][A-Za-z0-9_.\-]*)*)/([A-Za-z0-9][A-Za-z0-9_\-]*)=([A-Za-z0-9][A-Za-z0-9_.:\-]*)$"
)


def devices(annotations: Mapping[str, str]) -> list[str]:
    """The CDI devices a container's annotations name, sorted and each once. A value that is not
    a qualified device name is left out: the runtime refused to create such a container, so a
    running one does not have it."""
    names = {
        name.strip()
        for key, value in annotations.items()
        if key.startswith(ANNOTATION_PREFIX)
        for name in value.split(",")
        if _QUALIFIED.match(name.strip())
    }
    return sorted(names)


def kind(device: str) -> str:
    """`nvidia.com/gpu=0` -> `nvidia.com/gpu`."""
    return device.partition("=")[0]


def missing(had: Iterable[str], given: Iterable[str]) -> list[str]:
    """The job's devices (`had`) for which the placeholder (`given`) has no device of the same kind
    left over: empty when the placeholder was given at least as many of each kind."""
    left = Counter(kind(d) for d in given)
    out = []
    for d in sorted(had):
        if left[kind(d)] > 0:
            left[kind(d)] -= 1
        else:
            out.append(d)
    return out
