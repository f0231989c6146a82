# shellcheck shell=bash
# Sourced by scripts/build-kube.sh and scripts/build-kueue.sh: a cache entry built once from the
# Go module proxy.
#
#   ROOT           the checkout; versions files are read from $ROOT/scripts
#   cache_begin TOOL CACHE_ROOT KEY
#                  sets DEST=CACHE_ROOT/KEY (the entry), WORK=CACHE_ROOT/.build-KEY (the
#                  temporary Go caches, deleted after a good build) and LINK=.tools/TOOL; exits 0
#                  at once when the entry is complete (linking it); otherwise takes the entry's
#                  lock (a second build waits for the first) and exports the Go environment:
#                  module and build caches under $WORK, no cgo, the local toolchain.
#   wrap_build     go build one command of a module (below)
#   module_dir     where the module cache holds MODULE@VERSION's files
#   cache_finish   marks the entry complete, deletes $WORK and links the entry.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
# The machine is shared: leave some room for everyone else.
NICE="nice -n 10"

log() { echo "build-$TOOL: $*" >&2; }

link_tools() {
  mkdir -p "$(dirname "$LINK")"
  ln -sfn "$DEST" "$LINK"
}

cache_begin() {
  TOOL="$1" KEY="$3"
  DEST="$2/$KEY"
  WORK="$2/.build-$KEY"
  LINK="${XMEM_TOOLS_DIR:-$ROOT/.tools}/$TOOL"
  if [ -f "$DEST/.complete" ]; then
    link_tools
    exit 0
  fi
  if [ ! -x "$GO" ]; then
    log "no go toolchain (looked for 'go' on PATH and /usr/local/go/bin/go); cannot build $KEY"
    exit 1
  fi
  mkdir -p "$(dirname "$DEST")"
  exec 9>"$(dirname "$DEST")/.lock-$KEY"
  if ! flock -n 9; then
    log "another build of $KEY is running; waiting for it"
    flock 9
  fi
  if [ -f "$DEST/.complete" ]; then
    link_tools
    exit 0
  fi
  started=$(date +%s)
  mkdir -p "$DEST" "$WORK"
  export GOMODCACHE="$WORK/mod" GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath"
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod GOPROXY="${GOPROXY:-https://proxy.golang.org}"
  export GONOSUMDB="" GOFIPS140=off
}

# wrap_build BINARY MODULE VERSION PACKAGE LDFLAGS: build PACKAGE of MODULE@VERSION through a
# generated wrapper module that requires it, into $DEST/bin/BINARY (skipped when it is there).
wrap_build() {
  local name="$1" module="$2" version="$3" package="$4" ldflags="$5" mod="$WORK/wrap-$1"
  [ -x "$DEST/bin/$name" ] && return 0
  log "$module $version"
  mkdir -p "$mod" "$DEST/bin"
  printf 'module xmem.local/build/%s\n\ngo 1.26\n\nrequire %s %s\n' "$name" "$module" "$version" >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" >"$mod/tools.go"
  (cd "$mod" && "$GO" mod tidy)
  (cd "$mod" && $NICE "$GO" build -trimpath -ldflags "$ldflags" -o "$WORK/$name" "$package")
  mv -f "$WORK/$name" "$DEST/bin/$name"
}

module_dir() {
  "$GO" mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p'
}

cache_finish() {
  printf 'KEY=%s\nBUILT=%s\nSECONDS=%s\n' "$KEY" "$(date -u +%FT%TZ)" "$(( $(date +%s) - started ))" >"$DEST/.complete"
  # The module cache is read-only by design; make it deletable, then drop every temporary cache.
  chmod -R u+w "$WORK" 2>/dev/null || true
  rm -rf "$WORK"
  link_tools
  log "built $KEY in $(( $(date +%s) - started )) s: $(du -sh "$DEST" | cut -f1)"
}
