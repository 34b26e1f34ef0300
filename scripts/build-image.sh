#!/usr/bin/env bash
# Build the criuctl agent image from the Dockerfile (`make image`), as root.
#
#   scripts/build-image.sh                    build criuctl-agent:VERSION-gCOMMIT (and :VERSION)
#   scripts/build-image.sh --archive-dir DIR  also write it as a docker-archive into DIR, named by
#                                             the content key; with that file there, build nothing
#   scripts/build-image.sh --push REPO        also push it, as REPO:VERSION-gCOMMIT (e.g.
#                                             registry.example.com/criuctl-agent)
#   --base IMAGE                              the Debian 12 base (default: debian:bookworm-slim
#                                             pulled, or made here with mmdebstrap when no
#                                             registry answers)
#   --refresh-base                            make or pull the base again
#
# The builder is the first of buildah, podman, docker that works ($CRIUCTL_BUILDER to choose). The
# machine's package configuration reaches the build as build secrets (the Dockerfile's header): its
# CA bundle, its pip configuration, its apt sources; none is written into a layer.
# The last line printed is `KEY TAG [ARCHIVE]`: the content key (sha256 of every build input and
# of the base image's ID), the tag, and the archive when asked for one (tools/localcluster reads it).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
log() { echo "build-image: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"
usage() { sed -n '2,17s/^# \{0,1\}//p' "$0" >&2; exit "${1:-2}"; }

NAME=criuctl-agent
CACHE=${CRIUCTL_CACHE:-/usr/local/lib/criuctl}
BASE_REPO=localhost/criuctl-base/debian
BASE_MAX_AGE_DAYS=30 # a locally made base is reused this long, then made again (security updates)
# What the Dockerfile copies (its .dockerignore says the same): the content key hashes exactly these
INPUTS=(Dockerfile .dockerignore pyproject.toml setup.py MANIFEST.in README.md criuctl hooks
  scripts/install-criu.sh scripts/criu-patches scripts/lib.sh scripts/cri-proto.sh
  scripts/image-build-env.sh)

archive_dir="" push="" base="" refresh=0
while [ $# -gt 0 ]; do
  case $1 in
    --archive-dir) [ $# -ge 2 ] || usage; archive_dir=$2; shift 2 ;;
    --push) [ $# -ge 2 ] || usage; push=$2; shift 2 ;;
    --base) [ $# -ge 2 ] || usage; base=$2; shift 2 ;;
    --refresh-base) refresh=1; shift ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage ;;
  esac
done
[ "$(id -u)" = 0 ] || die "must run as root (the builder's storage is root's); try: sudo make image"

builder=${CRIUCTL_BUILDER:-}
if [ -z "$builder" ]; then
  for b in buildah podman docker; do
    command -v "$b" >/dev/null || continue
    # a docker client without its daemon cannot build: skip it
    if [ "$b" = docker ] && ! docker info >/dev/null 2>&1; then continue; fi
    builder=$b; break
  done
fi
if [ -z "$builder" ]; then
  log "no image builder here: installing Debian's buildah"
  apt_install buildah
  builder=buildah
fi
command -v "$builder" >/dev/null || die "CRIUCTL_BUILDER=$builder is not on PATH"

image_id() {
  case $builder in
    buildah) buildah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null ;;
    *) "$builder" image inspect --format '{{.Id}}' "$1" 2>/dev/null ;;
  esac
}
# the image's size unpacked, as the builder writes it ("214 MB")
image_size() { "$builder" images --format '{{.Size}}' "$1" 2>/dev/null | head -n1; }

# The Debian 12 base image: the one given; else the newest one made here within BASE_MAX_AGE_DAYS;
# else debian:bookworm-slim pulled from its registry; else one made now with mmdebstrap from this
# machine's Debian mirror, tagged with its date.
local_base() {
  local today newest="" t
  today=$(date -u +%Y%m%d)
  # buildah names the repository field .Name, podman and docker .Repository
  local field=.Repository; [ "$builder" != buildah ] || field=.Name
  for t in $("$builder" images --format "{{$field}}:{{.Tag}}" | grep "^$BASE_REPO:bookworm-slim-" | sort -r); do
    newest=$t; break
  done
  [ -n "$newest" ] || return 1
  local made=${newest##*-}
  local age=$((($(date -u -d "$today" +%s) - $(date -u -d "$made" +%s)) / 86400))
  [ "$age" -le $BASE_MAX_AGE_DAYS ] || return 1
  echo "$newest"
}

make_base() {
  local tag; tag=$BASE_REPO:bookworm-slim-$(date -u +%Y%m%d)
  command -v mmdebstrap >/dev/null || { log "installing Debian's mmdebstrap"; apt_install mmdebstrap; }
  local tmp; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
  local mirror; mirror=$(debian_uri)
  log "making the base $tag with mmdebstrap from $mirror (no registry answered)"
  # bookworm-slim's shape: minbase, merged /usr set up by mmdebstrap's hook (not the usrmerge
  # package, which would bring perl: 50 MB), no manuals, documentation or locales, no apt lists
  mmdebstrap --quiet --variant=minbase --mode=root --format=tar \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*.log' \
    bookworm "$tmp/rootfs.tar" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main" >&2
  case $builder in
    buildah)
      local c; c=$(buildah from scratch)
      buildah add "$c" "$tmp/rootfs.tar" / >/dev/null
      buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
      buildah commit -q --rm "$c" "$tag" >/dev/null ;;
    podman | docker)
      "$builder" import --change 'CMD ["/bin/bash"]' "$tmp/rootfs.tar" "$tag" >/dev/null ;;
  esac
  echo "$tag"
}

if [ -z "$base" ]; then
  if [ $refresh = 0 ] && base=$(local_base); then
    :
  elif [ $refresh = 0 ] && image_id docker.io/library/debian:bookworm-slim >/dev/null; then
    base=docker.io/library/debian:bookworm-slim
  elif timeout 60 "$builder" pull -q docker.io/library/debian:bookworm-slim >/dev/null 2>&1; then
    base=docker.io/library/debian:bookworm-slim
  else
    base=$(make_base)
  fi
fi
base_id=$(image_id "$base") || die "base image $base is not here (pull it, or leave --base out)"
log "base image: $base"

cd "$REPO"
version=$(awk -F'"' '/^version = /{print $2; exit}' pyproject.toml)
key=$( (printf '%s\n' "$base_id"
  find "${INPUTS[@]}" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum) \
  | sha256sum | cut -c1-16)
# The tag carries the version and the commit; a tree that differs from its commit in any input says
# so with the content key (two dirty builds are told apart, and never pass for the commit).
if commit=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  tag=$version-g$commit
  [ -z "$(git status --porcelain -- "${INPUTS[@]}" 2>/dev/null)" ] || tag=$tag-dirty-$key
else
  commit=unknown tag=$version-$key
fi

archive=""
if [ -n "$archive_dir" ]; then
  # one build per content at a time: a second cluster or test session waits, then reuses it
  mkdir -p "$archive_dir"
  exec 9>"$archive_dir/.build-image.lock"
  flock 9
  archive=$archive_dir/$NAME-$key.tar
  if [ -s "$archive" ] && [ -s "$archive.tag" ]; then
    log "reusing $archive ($(cat "$archive.tag"))"
    echo "$key $(cat "$archive.tag") $archive"
    exit 0
  fi
fi

secrets=()
ca=${CRIUCTL_BUILD_CA:-}
for f in "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
  [ -z "$ca" ] && [ -n "$f" ] && [ -s "$f" ] && ca=$f
done
[ -z "$ca" ] || secrets+=(--secret "id=ca,src=$ca")
pipconf=${PIP_CONFIG_FILE:-}
for f in /etc/pip.conf "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf"; do
  [ -z "$pipconf" ] && [ -s "$f" ] && pipconf=$f
done
[ -z "$pipconf" ] || secrets+=(--secret "id=pip.conf,src=$pipconf")
aptsrc=$(mktemp); trap 'rm -f "$aptsrc"' EXIT
# deb822 files where the machine has them, else its one-line lists (one format per file: apt tells
# them apart by the extension image-build-env.sh gives the copy)
cat /etc/apt/sources.list.d/*.sources 2>/dev/null >"$aptsrc" || true
[ -s "$aptsrc" ] || cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | grep -E '^[[:space:]]*deb' >"$aptsrc" || true
[ ! -s "$aptsrc" ] || secrets+=(--secret "id=apt.sources,src=$aptsrc")

log "building $NAME:$tag with $builder on $base (content key $key)"
start=$(date +%s)
build=("$builder" build)
case $builder in
  buildah) build=(buildah bud --layers --isolation chroot) ;;
  podman) build+=(--layers --isolation chroot) ;;
esac
"${build[@]}" --network host "${secrets[@]}" \
  --build-arg "DEBIAN_IMAGE=$base" --build-arg "SOURCE_COMMIT=$commit" \
  --label "org.opencontainers.image.version=$version" --label "io.criuctl.content-key=$key" \
  -t "$NAME:$tag" -t "$NAME:$version" -f Dockerfile . >&2
log "built $NAME:$tag in $(($(date +%s) - start)) s: $(image_size "$NAME:$tag")"

if [ -n "$push" ]; then
  "$builder" tag "$NAME:$tag" "$push:$tag"
  "$builder" push "$push:$tag" >&2
  log "pushed $push:$tag"
fi
if [ -n "$archive" ]; then
  mkdir -p "$archive_dir"
  rm -f "$archive.tmp"
  case $builder in
    docker) docker save -o "$archive.tmp" "$NAME:$tag" ;;
    *) "$builder" push -q "$NAME:$tag" "docker-archive:$archive.tmp:$NAME:$tag" >&2 ;;
  esac
  mv "$archive.tmp" "$archive"
  echo "$tag" >"$archive.tag"
  # older archives of this image: one per content key, only the newest two kept
  ls -t "$archive_dir/$NAME"-*.tar 2>/dev/null | tail -n +3 | while read -r old; do rm -f "$old" "$old.tag"; done
fi
echo "$key $tag${archive:+ $archive}"
