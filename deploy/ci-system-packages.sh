#!/usr/bin/env bash
# Debian packages that the deploy tests use, installed by `bash deploy/install.sh --test`:
#   slurmctld slurmd slurm-client munge  a private single-node Slurm (tests/test_deploy_slurm.py)
#   the ShellCheck linter                checks the deploy shell scripts (tests/test_deploy_sbatch.py)
# The Kubernetes tools (kustomize inside kubectl, the OpenAPI schemas) come from PyPI with the
# `test` extra. Idempotent and quiet: installs only what is missing, and only as root where apt-get
# exists; elsewhere it says what to install and the tests that need it skip with that reason.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge shellcheck)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "deploy/ci-system-packages.sh: not root or no apt-get: skipping ${missing[*]} (the tests that need them skip)"
  exit 0
fi

log=$(mktemp /tmp/rapidserve-apt.XXXXXX.log)
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1
}
# apt's package lists may be missing or stale on a fresh machine: update once if the first try fails
if ! install && ! { apt-get update -q >>"$log" 2>&1 && install; }; then
  echo "deploy/ci-system-packages.sh: apt-get could not install ${missing[*]}; last lines of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
rm -f "$log"
echo "deploy/ci-system-packages.sh: installed ${missing[*]}"
