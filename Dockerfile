# The criuctl node agent image (what manifests/daemonset.yaml and manifests/webhook.yaml run).
#
#   make image                      scripts/build-image.sh: buildah, podman or docker, whichever is
#                                   here; the machine's package configuration as build secrets; the
#                                   base made with mmdebstrap where no registry is reachable
#   docker build -t criuctl-agent:0.1.0 .      works as well (no secrets: the base image's defaults)
#
# Debian 12, with CRIU 4.2.1 built by scripts/install-criu.sh, the script `make` runs: the same
# checksum-verified source package (4.2.1 carries the socket fixes for kernels >= 6.16 and >= 7.1),
# with scripts/criu-patches/ applied (post-copy's page pull). The project is
# installed into /opt/criuctl/venv as a wheel, without extras: no torch, numpy or matplotlib (the
# agent never imports them); the wheel carries the hook tree and the CRI client stubs (setup.py).
# One image serves the agent and the webhook (another entrypoint argument): the webhook needs the
# same package and its dependencies, and one image is one build and one pull per node.
#
# Build secrets, each optional (scripts/image-build-env.sh reads them in every RUN that fetches
# packages; a secret is mounted for that step only, never written into a layer):
#   ca           a CA bundle for pip (the machine's own, e.g. behind a TLS-inspecting proxy)
#   pip.conf     pip's configuration (an index mirror)
#   apt.sources  apt's sources in deb822 form (a mirror), instead of the base image's

ARG DEBIAN_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------------------------------- build
FROM ${DEBIAN_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive
COPY scripts/image-build-env.sh /usr/local/bin/build-env
RUN --mount=type=secret,id=ca --mount=type=secret,id=pip.conf --mount=type=secret,id=apt.sources \
    build-env sh -c 'apt-get update -qq \
      && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates >/dev/null'

ENV VENV=/opt/criuctl/venv

# install-criu.sh ends with `criu check`, which needs privileges a build step does not have. A
# `criu` first on PATH passes everything to the real one (/usr/local/sbin/criu, once built) and
# reports `check` without failing the build, so the script runs unchanged; `criuctl doctor` runs
# the real check in the agent's pod.
RUN mkdir -p /opt/criu-shim \
 && printf '%s\n' '#!/bin/sh' \
      'if [ "$1" = check ]; then' \
      '  /usr/local/sbin/criu check || echo "criu check fails in an image build (no privileges); run criuctl doctor in the pod" >&2' \
      '  exit 0' \
      'fi' \
      'exec /usr/local/sbin/criu "$@"' >/opt/criu-shim/criu \
 && chmod 0755 /opt/criu-shim/criu

# CRIU first, in a layer of its own, so that a change to the Python code does not rebuild it. The
# script also wires pycriu into the venv it is given, and checks that it imports: here a scratch venv
# that sees Debian's python3-protobuf (one of the script's build dependencies). The patches it
# applies stay until the project's layer has run the script again.
COPY scripts/install-criu.sh scripts/lib.sh /opt/criuctl/src/scripts/
COPY scripts/criu-patches /opt/criuctl/src/scripts/criu-patches/
RUN --mount=type=secret,id=ca --mount=type=secret,id=pip.conf --mount=type=secret,id=apt.sources \
    python3 -m venv --system-site-packages /tmp/criu-venv \
 && PATH="/opt/criu-shim:$PATH" build-env bash /opt/criuctl/src/scripts/install-criu.sh /tmp/criu-venv \
 && rm -rf /tmp/criu-venv /usr/local/src/criuctl \
 && /usr/local/sbin/criu --version

# The project, into its venv as a wheel built from the source (not editable: the source does not go
# into the image). scripts/cri-proto.sh first fetches the CRI api.proto from Debian's containerd
# source package: the build generates the CRI client stubs (`criuctl_cri`) from it, with grpcio-tools
# in pip's isolated build environment (a build requirement, not in the venv). Then install-criu.sh,
# as `make` runs it after the venv: it finds CRIU built and copies pycriu into the venv (it must
# import with the venv's protobuf). Then what the agent never runs leaves the venv: pip and
# setuptools, and the kubernetes client's asyncio copy of itself (kubernetes/aio, 68 MB with its
# bytecode; criuctl uses the synchronous client, which never imports it).
COPY pyproject.toml setup.py MANIFEST.in README.md /opt/criuctl/src/
COPY scripts/cri-proto.sh scripts/lib.sh /opt/criuctl/src/scripts/
COPY criuctl /opt/criuctl/src/criuctl
COPY hooks /opt/criuctl/src/hooks
RUN --mount=type=secret,id=ca --mount=type=secret,id=pip.conf --mount=type=secret,id=apt.sources \
    build-env bash /opt/criuctl/src/scripts/cri-proto.sh \
 && python3 -m venv "$VENV" \
 && build-env "$VENV/bin/python" -m pip install -q --upgrade pip \
 && build-env "$VENV/bin/python" -m pip install -q --no-cache-dir /opt/criuctl/src \
 && PATH="/opt/criu-shim:$PATH" build-env bash /opt/criuctl/src/scripts/install-criu.sh "$VENV" \
 && rm -rf /usr/local/src/criuctl /opt/criuctl/src \
 && "$VENV/bin/python" -m pip uninstall -q -y pip setuptools \
 && rm -rf "$VENV"/lib/python3*/site-packages/kubernetes/aio \
 && "$VENV/bin/python" -c 'import pycriu.rpc_pb2, grpc, criuctl_cri.api_pb2_grpc, kubernetes.client' \
 && "$VENV/bin/criuctl" --help >/dev/null

# -------------------------------------------------------------------------------------- runtime
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# CRIU's shared libraries: the list install-criu.sh itself installs (RUNTIME_DEPS), read from the
# script so that the two cannot drift apart; python3 for the venv; nftables for CRIU's network lock;
# zstd for checkpoint archives compressed with it (CRI-O, podman).
COPY scripts/install-criu.sh /tmp/install-criu.sh
COPY scripts/image-build-env.sh /tmp/build-env
RUN --mount=type=secret,id=ca --mount=type=secret,id=pip.conf --mount=type=secret,id=apt.sources \
    eval "$(grep '^RUNTIME_DEPS=' /tmp/install-criu.sh)" \
 && /tmp/build-env sh -c "apt-get update -qq \
      && apt-get install -y -qq --no-install-recommends python3 nftables zstd $RUNTIME_DEPS >/dev/null" \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
      /tmp/install-criu.sh /tmp/build-env
COPY --from=build /usr/local/sbin/criu /usr/local/sbin/criu
COPY --from=build /usr/local/lib/criuctl /usr/local/lib/criuctl
COPY --from=build /opt/criuctl /opt/criuctl
ENV PATH=/opt/criuctl/venv/bin:$PATH \
    CRIUCTL_STATE_DIR=/var/lib/criuctl
# What `criuctl doctor` prints as this image (last: a new revision rebuilds nothing above)
ARG SOURCE_COMMIT=unknown
RUN criu --version >/dev/null && criuctl --help >/dev/null \
 && printf '{"revision": "%s", "criu": "%s"}\n' "$SOURCE_COMMIT" \
      "$(criu --version | awk '/^Version:/{print $2}')" >/opt/criuctl/image.json
LABEL org.opencontainers.image.title="criuctl-agent" \
      org.opencontainers.image.revision="${SOURCE_COMMIT}"
EXPOSE 7070
ENTRYPOINT ["criuctl"]
CMD ["agent", "--help"]
