#!/usr/bin/env bash
# System packages the build and the tests need: quilt and patch (series
# checks), g++ and OpenSSL headers (sglang JIT-builds its HiCache hash
# extension on first use), libibverbs1 and librdmacm1 (mooncake, live PD test).  Installs the missing ones with apt-get (as root, or
# through passwordless sudo); otherwise names them and exits 2.
set -euo pipefail

missing=()
command -v quilt >/dev/null || missing+=(quilt)
command -v patch >/dev/null || missing+=(patch)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
# mooncake's transfer engine (live PD test) links them even in TCP-only mode.
libs=$(ldconfig -p 2>/dev/null || true)  # not piped into grep -q: pipefail
[[ $libs == *"libibverbs.so.1 "* ]] || missing+=(libibverbs1)
[[ $libs == *"librdmacm.so.1 "* ]] || missing+=(librdmacm1)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  sudo=none
fi
if [ "${sudo[*]-}" = none ] || ! command -v apt-get >/dev/null; then
  echo "missing system packages: ${missing[*]}; install them (Debian/Ubuntu: apt-get install ${missing[*]}) and run make again" >&2
  exit 2
fi
echo "installing system packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
