#!/usr/bin/env bash
# Entry point of the ringfeed images, and the ssh setup that tests/test_multinode.py reuses.
#
#   entrypoint.sh keygen DIR                         client key pair + authorized_keys in DIR, made
#                                                    once per job and shared by all its containers
#   entrypoint.sh sshd-config DIR PORT AUTH_KEYS     host key + sshd_config under DIR; prints the
#                                                    config's path (works without root)
#   entrypoint.sh ssh-config KEY PORT KNOWN_HOSTS    client config (for ~/.ssh/config) on stdout
#   entrypoint.sh CMD [ARG...]                       optional sshd + wait for peers, then exec CMD
#
# Env for the last form: RINGFEED_SSHD=1 starts sshd on RINGFEED_SSH_PORT (2222) with the key
# pair in RINGFEED_SSH_DIR (/var/lib/ringfeed/ssh, a volume shared by the job's containers;
# made there by the first container to start);
# RINGFEED_WAIT_FOR_SSH="host1 host2" waits (RINGFEED_WAIT_S, 120 s) until each host accepts ssh.
# Keys are made at run time, never baked into an image.
set -euo pipefail

die() { echo "ringfeed-entrypoint: $*" >&2; exit 1; }

keygen() {
  local dir="$1" waited=0
  mkdir -p "$dir"
  chmod 700 "$dir"
  [ -s "$dir/authorized_keys" ] && return 0
  # Every container of a job may call this at once: the one that makes the lock directory
  # makes the pair, the others wait for authorized_keys, which is renamed into place last.
  if mkdir "$dir/.keygen.lock" 2>/dev/null; then
    rm -f "$dir/.new_key" "$dir/.new_key.pub"
    ssh-keygen -q -t ed25519 -N "" -C "ringfeed-job" -f "$dir/.new_key"
    chmod 600 "$dir/.new_key" "$dir/.new_key.pub"
    cp "$dir/.new_key.pub" "$dir/.authorized_keys.new"
    mv "$dir/.new_key" "$dir/id_ed25519"
    mv "$dir/.new_key.pub" "$dir/id_ed25519.pub"
    mv "$dir/.authorized_keys.new" "$dir/authorized_keys"
    rmdir "$dir/.keygen.lock"
  else
    until [ -s "$dir/authorized_keys" ]; do
      [ "$waited" -lt 60 ] || die "no key pair in $dir after 60 s; if no other container is making one, remove $dir/.keygen.lock"
      sleep 1
      waited=$((waited + 1))
    done
  fi
}

sshd_config() {
  local dir="$1" port="$2" auth_keys="$3"
  mkdir -p "$dir"
  chmod 700 "$dir"
  [ -s "$dir/ssh_host_ed25519_key" ] \
    || ssh-keygen -q -t ed25519 -N "" -C "ringfeed-host" -f "$dir/ssh_host_ed25519_key"
  cat >"$dir/sshd_config.new" <<EOF
# Written by ringfeed-entrypoint: key-only logins for horovodrun/mpirun between job hosts.
Port $port
HostKey $dir/ssh_host_ed25519_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $auth_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin no
X11Forwarding no
PrintMotd no
EOF
  mv "$dir/sshd_config.new" "$dir/sshd_config"
  echo "$dir/sshd_config"
}

ssh_config() {
  local key="$1" port="$2" known_hosts="$3"
  cat <<EOF
# Written by ringfeed-entrypoint: the job's hosts trust each other's freshly made host keys.
Host *
  Port $port
  IdentityFile $key
  IdentitiesOnly yes
  UserKnownHostsFile $known_hosts
  StrictHostKeyChecking accept-new
  BatchMode yes
  ConnectTimeout 10
  LogLevel ERROR
EOF
}

start_sshd() {
  local shared="${RINGFEED_SSH_DIR:-/var/lib/ringfeed/ssh}" port="${RINGFEED_SSH_PORT:-2222}"
  local state="$HOME/.ringfeed-sshd" config
  keygen "$shared"
  config="$(sshd_config "$state" "$port" "$shared/authorized_keys")"
  mkdir -p "$HOME/.ssh"
  chmod 700 "$HOME/.ssh"
  ssh_config "$shared/id_ed25519" "$port" "$HOME/.ssh/known_hosts" >"$HOME/.ssh/config"
  # sshd must be started by its absolute path; it daemonizes, PID 1 stays the user's command.
  /usr/sbin/sshd -f "$config" -E "$state/sshd.log" || die "sshd did not start (log: $state/sshd.log)"
}

wait_for_ssh() {
  local deadline=$((SECONDS + ${RINGFEED_WAIT_S:-120})) host
  for host in "$@"; do
    until ssh "$host" true 2>/dev/null; do
      [ "$SECONDS" -lt "$deadline" ] || die "no ssh to $host after ${RINGFEED_WAIT_S:-120} s"
      sleep 1
    done
  done
}

case "${1:-}" in
  keygen) [ $# -eq 2 ] || die "usage: keygen DIR"; keygen "$2" ;;
  sshd-config) [ $# -eq 4 ] || die "usage: sshd-config DIR PORT AUTH_KEYS"; sshd_config "$2" "$3" "$4" ;;
  ssh-config) [ $# -eq 4 ] || die "usage: ssh-config KEY PORT KNOWN_HOSTS"; ssh_config "$2" "$3" "$4" ;;
  "") die "no command given (try: ringfeed --help)" ;;
  *)
    if [ "${RINGFEED_SSHD:-0}" = 1 ]; then start_sshd; fi
    if [ -n "${RINGFEED_WAIT_FOR_SSH:-}" ]; then
      # shellcheck disable=SC2086  # a space-separated host list, split on purpose
      wait_for_ssh ${RINGFEED_WAIT_FOR_SSH}
    fi
    exec "$@" ;;
esac
