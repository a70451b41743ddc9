#!/usr/bin/env bash
# Install pgvector into the machine's Postgres (Debian), for vector search (vec:/hyde: lines).
#
# Debian 12 (bookworm) packages no pgvector for its Postgres 15, not even in bookworm-backports, so
# this builds the extension from Debian's own source package (trixie's `pgvector`, fetched with
# `apt-get source` through the same mirror the machine already uses) against
# postgresql-server-dev-<major>. Idempotent: does nothing when the server already offers `vector`.
# Run as root. Afterwards `factmill db upgrade` (new databases) or `factmill embed` (existing ones)
# sets up the vector store.
set -euo pipefail

# (|| true: with no match, ls failed the assignment under pipefail, and the script died without its message)
PG_CONFIG=${PG_CONFIG:-$(ls -d /usr/lib/postgresql/*/bin/pg_config 2>/dev/null | sort -V | tail -1 || true)}
[ -x "$PG_CONFIG" ] || { echo "install-pgvector: no Postgres server installation found" >&2; exit 1; }
MAJOR=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
if [ -f "$("$PG_CONFIG" --sharedir)/extension/vector.control" ]; then
  echo "install-pgvector: pgvector is already installed for Postgres $MAJOR"
  exit 0
fi
apt-get update -qq
if apt-cache show "postgresql-$MAJOR-pgvector" >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "postgresql-$MAJOR-pgvector"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
  "postgresql-server-dev-$MAJOR" make gcc >/dev/null
# A deb-src entry for trixie on the mirror the machine already uses, in a private apt state.
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
mkdir -p "$work/lists/partial"
cat > "$work/src.sources" <<SOURCES
Types: deb-src
URIs: $mirror
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work" -o "Dir::State::Lists=$work/lists"
          -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only pgvector >/dev/null 2>&1)
tar -xzf "$work"/pgvector_*.orig.tar.gz -C "$work"
src=$(ls -d "$work"/pgvector-*/ | head -1)
# OPTFLAGS="": no -march=native, so the build runs on any x86-64 machine it is copied to.
make -C "$src" PG_CONFIG="$PG_CONFIG" OPTFLAGS="" >/dev/null
make -C "$src" PG_CONFIG="$PG_CONFIG" OPTFLAGS="" install >/dev/null
echo "install-pgvector: built and installed pgvector $(basename "$src" | sed 's/pgvector-//') for Postgres $MAJOR"
